# Keep `python -m qkv` from running when pytest imports modules for their doctests.
collect_ignore = ["src/qkv/__main__.py"]
