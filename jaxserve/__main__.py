"""`python -m jaxserve ...`: the `jaxserve` command (jaxserve/cli.py), for a venv whose
bin/ is not on PATH."""

from jaxserve.cli import main

if __name__ == "__main__":
    main()
