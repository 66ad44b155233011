# syntax=docker/dockerfile:1
# Images for the API and the workers (see docker-compose.yml). Targets:
#   api     the HTTP API; no torch:  docker build --target api -t bnadapt-api .
#   worker  an RQ worker with torch, CPU wheels by default:
#           docker build --target worker -t bnadapt-worker .
#           for CUDA: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
#           (pick the index that has TORCH_VERSION for your driver)
# Both run as the unprivileged user `bnadapt` (uid 10001), with the store volume at /data.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    BNADAPT_DATA_DIR=/data
# /data is created owned by bnadapt so that a fresh named volume mounted there inherits it.
RUN python -m venv /opt/venv \
    && groupadd --system --gid 10001 bnadapt \
    && useradd --system --uid 10001 --gid bnadapt --create-home --home-dir /home/bnadapt \
        --shell /usr/sbin/nologin bnadapt \
    && mkdir /data \
    && chown bnadapt:bnadapt /data
WORKDIR /home/bnadapt

# The project as a wheel, built once; the images install it without the source tree.
FROM base AS wheel
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheels /src

FROM base AS api
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install "$(ls /wheels/bnadapt-*.whl)[s3]"
USER bnadapt
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["bnadapt"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG TORCHVISION_VERSION=0.28.0
# torch and torchvision first, from their own index: the `worker` and `zoo` extras' ranges are
# then satisfied and pip does not replace them with the default (CUDA) builds from PyPI. The
# `zoo` extra adds timm (torchvision's and timm's models as architectures).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    "torchvision==${TORCHVISION_VERSION}"
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install "$(ls /wheels/bnadapt-*.whl)[worker,s3,zoo]"
USER bnadapt
VOLUME ["/data"]
ENTRYPOINT ["bnadapt"]
CMD ["worker", "--device", "auto"]
