"""`python -m minivllm.server [flags]`: the same as `minivllm serve`."""

from .launch import main

if __name__ == "__main__":
    main()
