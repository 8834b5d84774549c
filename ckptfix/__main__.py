"""`python -m ckptfix`: the same command line as `ckptfix`."""

from ckptfix.cli import main

if __name__ == "__main__":
    main()
