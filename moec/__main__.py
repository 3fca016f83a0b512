"""`python3 -m moec ...`: the CLI without the installed entry point (a checkout on a machine where moec is not
pip-installed, as the GPU machine runs one)."""

from .cli.app import main

main()
