"""The artifact store: content-addressed objects (weights, datasets, reports).

- :mod:`service.store.base` — the :class:`Store` protocol every backend implements;
- :mod:`service.store.local` — a local directory (or a mount shared by API and workers);
- :mod:`service.store.gc` — the collector of objects nothing uses;
- :func:`open_store` — the one way to open the store the settings name.
"""

from service.settings import Settings
from service.store.base import Store
from service.store.local import LocalStore

__all__ = ["open_store"]


def open_store(settings: Settings) -> Store:
    """The store the settings name: today a local directory, ``BNADAPT_STORE_DIR`` (default
    ``<data dir>/store``). A new backend is chosen here, and nowhere else."""
    return LocalStore(settings.store_path)
