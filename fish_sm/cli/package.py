"""`fish-sm package`: build model.tar.gz from a checkpoint, and upload it."""

from __future__ import annotations

from pathlib import Path

import click

from fish_sm.cli.common import aws_options, friendly_errors, human_size, main, make_aws


@main.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("model.tar.gz"),
              show_default=True, help="The tarball to write.")
@click.option("--voice", "voices", multiple=True, metavar="ID=AUDIO[:TRANSCRIPT]",
              help="A voice to ship with the model: TRANSCRIPT is the text or @FILE; without it AUDIO's "
                   ".txt/.lab sidecar is read. Repeatable.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=PATH",
              help="A LoRA fine-tune to serve beside the base model, by NAME: upstream's training checkpoint "
                   "(.ckpt), a .pth of its lora_A/lora_B tensors, or a .safetensors; checked tensor by tensor "
                   "against the checkpoint. A --voice of the same NAME speaks with it. Repeatable.")
@click.option("--lora-alpha", "lora_alphas", multiple=True, metavar="NAME=ALPHA",
              help="An --adapter's lora_alpha (default: the file's metadata, else 16, upstream's "
                   "r_8_alpha_16). Repeatable.")
@click.option("--compile-cache", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A torch.compile cache built on the target GPU, shipped to skip compiling at start-up.")
@click.option("--stock-container", is_flag=True,
              help="Carry the stock PyTorch container's dependencies in the package (code/lib, no "
                   "requirements.txt), so it starts without internet access: network isolation, a VPC "
                   "without NAT. Downloads their wheels for the container's Python 3.12 with pip.")
@click.option("--wheels", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="With --stock-container: take the wheels from this directory (as `pip download` "
                   "wrote them) instead of downloading.")
@click.option("--upload", metavar="s3://BUCKET/PREFIX/", help="Upload the tarball here (a prefix gets its file name).")
@click.option("--part-size", type=click.IntRange(5, 5 * 1024), default=64, show_default=True,
              help="MiB per part of the multipart upload (S3 allows 5 MiB to 5 GiB).")
@click.option("--compress-level", type=click.IntRange(0, 9), default=1, show_default=True,
              help="gzip level; weights barely compress, so 1 saves minutes.")
@aws_options
@friendly_errors
def package(checkpoint_dir, output, voices, adapters, lora_alphas, compile_cache, stock_container, wheels, upload,
            part_size, compress_level, region, profile, endpoint_url):
    """Build model.tar.gz from CHECKPOINT_DIR (or archive an already built package directory).

    The archive is reproducible: the same inputs give the same bytes and sha256.
    """
    import tempfile

    from fish_sm.aws.package import upload as upload_tarball
    from fish_sm.aws.s3 import MIB, check_bucket, parse_s3_uri
    from fish_sm.cli.package_inputs import is_package_dir, parse_adapter_specs, parse_voice_specs
    from fish_sm.cli.progress import ByteProgress, FileProgress
    from fish_sm.package.tarball import make_tarball

    def archive(src: Path):
        with ByteProgress(f"archiving {output.name}") as bar:
            return make_tarball(src, output, compresslevel=compress_level, progress=bar)

    if wheels is not None and not stock_container:
        raise click.UsageError("--wheels applies only with --stock-container")
    dest = parse_s3_uri(upload, what="--upload") if upload else None
    if dest is not None:  # fail before the long work, not after it
        aws = make_aws(region, profile, endpoint_url)
        check_bucket(aws, dest)
    parsed = parse_voice_specs(voices)
    fine_tunes = parse_adapter_specs(adapters, lora_alphas)
    vendored, packaged_adapters = None, {}
    if is_package_dir(checkpoint_dir):
        if parsed or fine_tunes or compile_cache or stock_container:
            raise click.UsageError(f"{checkpoint_dir} is a built package: --voice, --adapter, --compile-cache and "
                                   "--stock-container apply only when packaging a checkpoint")
        from fish_sm.package.verify import verify_package

        verify_package(checkpoint_dir)  # a package changed since it was built is refused, not shipped
        tarball = archive(checkpoint_dir)
    else:
        from fish_sm.package.build import build_package_dir

        output.parent.mkdir(parents=True, exist_ok=True)
        # Next to the output rather than in /tmp: the package is as big as the checkpoint.
        with tempfile.TemporaryDirectory(prefix=".fish-sm-package-", dir=output.parent) as tmp:
            package_dir = Path(tmp) / "model"
            vendor_wheels = stock_wheels(wheels, Path(tmp) / "wheels") if stock_container else None
            extra = {"adapters": fine_tunes} if fine_tunes else {}
            with FileProgress() as progress:
                manifest = build_package_dir(checkpoint_dir, package_dir, parsed, compile_cache, progress=progress,
                                             vendor_wheels=vendor_wheels, **extra)
            vendored, packaged_adapters = manifest.get("vendored"), manifest.get("adapters") or {}
            tarball = archive(package_dir)
    click.echo(f"wrote {tarball.path}: {human_size(tarball.size)}, {tarball.files} files, sha256 {tarball.sha256}"
               + (f", voices: {', '.join(parsed)}" if parsed else "")
               + (", adapters: " + ", ".join(f"{n} (rank {a['rank']})" for n, a in packaged_adapters.items())
                  if packaged_adapters else "")
               + (f", vendored for the stock container: {len(vendored)} wheels" if vendored else ""))
    if dest is not None:
        with ByteProgress(f"uploading {tarball.path.name}") as bar:
            uri = upload_tarball(aws, tarball.path, dest, part_size=part_size * MIB, progress=bar)
        click.echo(str(uri))


def stock_wheels(wheels: Path | None, download_to: Path) -> list[Path]:
    """The stock container's wheels: from --wheels, else downloaded for its Python and platform."""
    from fish_sm.package.vendor import STOCK_PLATFORM, STOCK_PYTHON, download_wheels, find_wheels

    if wheels is not None:
        return find_wheels(wheels)
    click.echo(f"downloading the stock container's wheels (Python {STOCK_PYTHON}, {STOCK_PLATFORM})", err=True)
    return download_wheels(download_to)
