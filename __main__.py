"""``python -m kvgen``: the same commands as the ``kvgen`` console script."""

from .cli import main

main(prog_name="kvgen")
