"""The ``bnadapt`` commands on what a tenant registers, through the API:
``architectures``, ``models add|list|download|delete``, ``datasets add|list|delete``."""

from __future__ import annotations

import argparse
import sys
from fnmatch import fnmatchcase
from pathlib import Path

from api_schemas import ArchitecturePublic
from api_schemas.architectures import architecture_family
from service.errors import BnadaptError
from service.local.cli.options import Commands, add_id_command, add_list_command
from service.local.cli_client import api_client, json_arg, preprocessing_arg, print_value
from service.local.torch_weights import PTH_SUFFIXES, pth_to_safetensors

__all__ = ["declare_architectures", "declare_datasets", "declare_models"]


def declare_architectures(commands: Commands) -> None:
    arches = commands.add_parser(
        "architectures",
        help="list what can be registered: families with counts (the zoo has over a thousand)",
    )
    arches.add_argument(
        "pattern",
        nargs="?",
        help="list the architectures whose name matches this fnmatch pattern or contains it "
        "(e.g. 'timm.resnet*', 'convnext'), one a line with kwargs and input shape",
    )
    arches.add_argument("--all", action="store_true", help="list every architecture, one a line")
    arches.set_defaults(func=cmd_architectures)


def cmd_architectures(args: argparse.Namespace) -> int:
    """Families with counts and a few names; one line per architecture with ``--all`` or a
    pattern. Built-ins (names without a dot) are always listed one a line."""
    arches = api_client(args).architectures()
    pattern = getattr(args, "pattern", None)
    if pattern:
        arches = [a for a in arches if fnmatchcase(a.name, pattern) or pattern in a.name]
    if getattr(args, "all", False) or pattern:
        for arch in arches:
            print(_architecture_line(arch))
        return 0
    families: dict[str, list[str]] = {}
    for arch in arches:
        if "." not in arch.name:
            print(_architecture_line(arch))
        else:
            families.setdefault(architecture_family(arch.name), []).append(arch.name)
    for family, names in sorted(families.items()):
        sample = ", ".join(n.split(".", 1)[1] for n in names[:4])
        more = f", ... (+{len(names) - 4})" if len(names) > 4 else ""
        print(f"{family:24} {len(names):4} models: {sample}{more}")
    if families:
        print(
            f"{sum(map(len, families.values()))} zoo architectures in {len(families)} families; "
            "`bnadapt architectures PATTERN` lists their kwargs, --all lists every one",
            file=sys.stderr,
        )
    return 0


def _architecture_line(arch: ArchitecturePublic) -> str:
    kwargs = ", ".join(f"{p.name}={p.default!r}" for p in arch.params)
    shape = "x".join("*" if d is None else str(d) for d in arch.input_shape)
    return f"{arch.name:24} input {shape:12} kwargs: {kwargs}"


def declare_models(commands: Commands) -> None:
    models = commands.add_parser("models", help="models: register, list, download, delete")
    subcommands = models.add_subparsers(dest="models", required=True)
    _declare_models_add(subcommands)
    _declare_models_list(subcommands)
    _declare_models_download(subcommands)
    _declare_models_delete(subcommands)


def _declare_models_add(models: Commands) -> None:
    add = models.add_parser("add", help="register a model")
    add.add_argument("architecture", help="a name from `bnadapt architectures`")
    add.add_argument(
        "--kwargs", type=json_arg, default={}, help="the architecture's kwargs, a JSON object"
    )
    add.add_argument(
        "--weights",
        help="a .safetensors file, or a .pth/.pt state_dict (or checkpoint wrapping one) that "
        "is converted to safetensors here with torch (else: initialised with --seed)",
    )
    add.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    add.set_defaults(func=cmd_models_add)


def cmd_models_add(args: argparse.Namespace) -> int:
    """A ``.pth`` file is converted to safetensors here, before it is sent (the service never
    unpickles): service/local/torch_weights.py."""
    weights: Path | bytes | None = Path(args.weights) if args.weights else None
    if isinstance(weights, Path) and weights.suffix.lower() in PTH_SUFFIXES:
        converted = pth_to_safetensors(weights)
        print(f"converted {weights} to safetensors ({len(converted):,} bytes)", file=sys.stderr)
        weights = converted
    model = api_client(args).add_model(args.architecture, args.kwargs, weights, args.seed)
    if model.renamed_keys is not None:
        renamed = model.renamed_keys
        what = ", ".join(
            [*(f"prefix {p!r}" for p in renamed.stripped_prefixes), renamed.layout or ""]
        )
        print(f"renamed {renamed.count} keys: {what.strip(', ')}", file=sys.stderr)
    print_value(model)
    return 0


def _declare_models_list(models: Commands) -> None:
    add_list_command(models, "your models, newest first", cmd_models_list)


def cmd_models_list(args: argparse.Namespace) -> int:
    for model in api_client(args).models(page_size=args.page_size).items:
        print(f"{model.id}  {model.architecture:16} {model.source:6} parent={model.parent}")
    return 0


def _declare_models_download(models: Commands) -> None:
    download = add_id_command(
        models, "download", "model", "a model's weights as .safetensors", cmd_models_download
    )
    download.add_argument("--out", help="file to write (default: <model id>.safetensors)")


def cmd_models_download(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(f"{args.model_id}.safetensors")
    print(api_client(args).download_weights(args.model_id, out))
    return 0


def _declare_models_delete(models: Commands) -> None:
    add_id_command(
        models,
        "delete",
        "model",
        "delete a model (jobs that used it keep working)",
        cmd_models_delete,
    )


def cmd_models_delete(args: argparse.Namespace) -> int:
    api_client(args).delete_model(args.model_id)
    print(f"deleted model {args.model_id}", file=sys.stderr)
    return 0


def declare_datasets(commands: Commands) -> None:
    datasets = commands.add_parser("datasets", help="datasets: upload, list, delete")
    subcommands = datasets.add_subparsers(dest="datasets", required=True)
    _declare_datasets_add(subcommands)
    _declare_datasets_list(subcommands)
    _declare_datasets_delete(subcommands)


def _declare_datasets_add(datasets: Commands) -> None:
    add = datasets.add_parser(
        "add", help="upload an .npz, .safetensors or image .tar file, or a folder of images"
    )
    add.add_argument(
        "file",
        help="the file to upload, or a folder of images (class subfolders are labels, "
        "numbered as torchvision's ImageFolder numbers them; a flat folder is unlabelled)",
    )
    add.add_argument(
        "--preprocessing",
        type=preprocessing_arg,
        help='how images become inputs: a JSON object (\'{"resize_shorter": 256, '
        '"center_crop": [224, 224], "interpolation": "bicubic"}\') or a JSON file',
    )
    add.add_argument("--name", help="a name to show (default: the file's)")
    add.add_argument(
        "--resume",
        metavar="UPLOAD_ID",
        help="continue an interrupted upload (its id is printed when it starts)",
    )
    add.set_defaults(func=cmd_datasets_add)


def cmd_datasets_add(args: argparse.Namespace) -> int:
    """A resumable upload with a progress bar on stderr; the dataset as JSON on stdout."""
    client = api_client(args)
    path = Path(args.file)
    interactive = sys.stderr.isatty()
    announced = False

    def show(done: int, total: int) -> None:
        nonlocal announced
        if not announced:
            print(
                f"upload {client.last_upload_id}: if it is interrupted, resume it with "
                f"bnadapt datasets add {path} --resume {client.last_upload_id}",
                file=sys.stderr,
            )
            announced = True
        share = done / total if total else 1.0
        bar = "#" * int(share * 30)
        line = f"[{bar:30}] {share:6.1%} {done / 1e6:,.1f} of {total / 1e6:,.1f} MB"
        print(
            f"\r{line}" if interactive else line,
            end="" if interactive else "\n",
            file=sys.stderr,
            flush=True,
        )

    if args.preprocessing == "model":
        raise BnadaptError(
            "a dataset takes a preprocessing spec, not 'model' (a dataset serves any model): "
            "give 'model' to a job instead (bnadapt jobs submit ... --preprocessing model)"
        )
    if path.is_dir():
        if args.resume:
            raise BnadaptError("--resume continues the upload of a file; send a folder again whole")

        def skipped(paths: list[Path]) -> None:
            listed = ", ".join(str(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
            print(f"left out {len(paths)} files that are no .jpg/.png: {listed}", file=sys.stderr)

        dataset = client.upload_folder(
            path,
            args.name,
            preprocessing=args.preprocessing,
            on_progress=show,
            on_skipped=skipped,
        )
    else:
        dataset = client.upload_dataset(
            path,
            args.name,
            upload_id=args.resume,
            on_progress=show,
            preprocessing=args.preprocessing,
        )
    if interactive:
        print(file=sys.stderr)
    print_value(dataset)
    return 0


def _declare_datasets_list(datasets: Commands) -> None:
    add_list_command(datasets, "your datasets, newest first", cmd_datasets_list)


def cmd_datasets_list(args: argparse.Namespace) -> int:
    for dataset in api_client(args).datasets(page_size=args.page_size).items:
        shape = "x".join(str(d) for d in dataset.sample_shape)
        labels = dataset.label_kind or "no labels"
        print(f"{dataset.id}  {dataset.num_samples:8} x {shape:12} {labels:9} {dataset.name or ''}")
    return 0


def _declare_datasets_delete(datasets: Commands) -> None:
    add_id_command(datasets, "delete", "dataset", "delete a dataset", cmd_datasets_delete)


def cmd_datasets_delete(args: argparse.Namespace) -> int:
    api_client(args).delete_dataset(args.dataset_id)
    print(f"deleted dataset {args.dataset_id}", file=sys.stderr)
    return 0
