"""The `ferry` command. `ferry publish` writes a checkpoint to S3 and applies its WeightVersion (docs/publish.md)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ferry import __version__
from ferry.errors import Conflict, FerryError, InvalidInput, NotFound, Transient
from ferry.publish import (
    DEFAULT_MULTIPART_THRESHOLD,
    DEFAULT_SHARD_BYTES,
    PublishError,
    PublishOptions,
    PublishResult,
    parse_size,
    publish,
)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_publish(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "publish",
        help="write a full checkpoint or an XOR delta to S3 and apply its WeightVersion",
        description="Write SOURCE as <uri-prefix>/<version>/model.safetensors.index.json plus shards (immutable: an "
        "existing object with other content is an error), then create the WeightVersion.",
    )
    p.add_argument("source", type=Path, help="a directory of *.safetensors, one .safetensors file, or a .pt state dict")
    p.add_argument("--version", required=True, help="the WeightVersion name (the version id)")
    p.add_argument("--uri-prefix", required=True, help="s3://bucket/prefix; objects go under <prefix>/<version>/")
    p.add_argument("--model", help="spec.modelName (required unless --no-apply)")
    p.add_argument("--base", help="publish an XorDelta against this WeightVersion instead of a FullCheckpoint")
    p.add_argument(
        "--base-dir",
        type=Path,
        help="the base's full weights on local disk; without it the base is rebuilt from S3 (its chain replayed)",
    )
    p.add_argument("--layout-signature", help="spec.layoutSignature")
    p.add_argument("--endpoint", help="S3 endpoint URL (MinIO, SeaweedFS...); also written to spec.storage.endpoint")
    p.add_argument("--region", help="S3 region; also written to spec.storage.region")
    p.add_argument("--credentials-secret", help="spec.storage.credentialsSecret: the Secret readers use")
    p.add_argument("--namespace", "-n", default="default", help="namespace of the WeightVersion (default: default)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG / ~/.kube/config)")
    p.add_argument("--no-apply", dest="apply", action="store_false", help="only upload; do not create the object")
    p.add_argument("--wait", action="store_true", help="wait until the operator marks the WeightVersion Ready")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits (default 300)")
    p.add_argument("--shard-size", type=_size, default=DEFAULT_SHARD_BYTES, help="tensor bytes per shard (4GiB)")
    p.add_argument(
        "--multipart-threshold",
        type=_size,
        default=DEFAULT_MULTIPART_THRESHOLD,
        help="objects this big or bigger are uploaded in parts of this size (default 64MiB, at least 5MiB parts)",
    )
    p.add_argument("--workers", type=int, default=8, help="parallel part uploads (default 8)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    p.set_defaults(run=_run_publish)


def _run_publish(args: argparse.Namespace) -> int:
    opts = PublishOptions(
        source=args.source,
        version=args.version,
        uri_prefix=args.uri_prefix,
        model=args.model,
        base=args.base,
        base_dir=args.base_dir,
        layout_signature=args.layout_signature,
        endpoint=args.endpoint,
        region=args.region,
        credentials_secret=args.credentials_secret,
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        apply=args.apply,
        wait=args.wait,
        wait_timeout=args.timeout,
        shard_bytes=args.shard_size,
        multipart_threshold=args.multipart_threshold,
        workers=args.workers,
    )
    _report(publish(opts, progress=None if args.quiet else sys.stderr), opts)
    return 0


def _report(result: PublishResult, opts: PublishOptions) -> None:
    kept = f", {len(result.identical)} already there" if result.identical else ""
    print(
        f"published {opts.version} ({result.format}, {result.stored_bytes / 1e6:.1f} MB) to {result.uri}: "
        f"{len(result.written)} objects written{kept}"
    )
    if result.weight_version:
        print(f"weightversion.ferry.dev/{opts.version} {result.weight_version} in namespace {opts.namespace}")


# Exit statuses (docs/publish.md): a script retries 6, picks a new name on 3, and fixes its input on 4 and 5.
EXIT_FAILED, EXIT_USAGE, EXIT_CONFLICT, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_TRANSIENT = 1, 2, 3, 4, 5, 6


def exit_status(exc: FerryError) -> int:
    for kind, status in (
        (Conflict, EXIT_CONFLICT),
        (InvalidInput, EXIT_INVALID),
        (NotFound, EXIT_NOT_FOUND),
        (Transient, EXIT_TRANSIENT),
    ):
        if isinstance(exc, kind):
            return status
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry: model weights into GPU memory")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_publish(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except PublishError as exc:
        print(f"ferry {args.command}: error: {exc}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        print(f"ferry {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
