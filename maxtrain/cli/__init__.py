"""The command-line entry points (`python -m maxtrain.X` runs cli/X.py), each a thin `main` over the one
shell (`shell.py`: parsing, overrides, --help, logging, exit codes)."""
