"""The `dflash-mlx` command line: one module per command, each with its own `main`.

A command's heavy imports (mlx-lm, the model code) happen inside its `main`,
so that `--help` and a bad option answer at once."""

from typing import Optional

import typer

from dflash_mlx.cli import bench, convert, doctor, generate, list_models, serve, train
from dflash_mlx.cli.common import err
from dflash_mlx.cli.warning_lines import show_warnings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="DFlash block-diffusion speculative decoding on MLX.",
)


def _version(value: Optional[bool]) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"dflash-mlx {version('dflash-mlx')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                           help="Print the version and exit."),
):
    """DFlash block-diffusion speculative decoding on MLX."""
    show_warnings(err)


app.command("generate")(generate.main)
app.command("serve")(serve.main)
app.command("bench")(bench.main)
app.command("convert")(convert.main)
app.command("train")(train.main)
app.command("doctor")(doctor.main)
app.command("list")(list_models.main)

if __name__ == "__main__":
    app()
