"""Collection of the doctests under src/qkv: the qkv.torch package imports torch at the top
(extra ``torch``), so without torch its modules are not collected; tests/test_torch_*.py
skip with a reason of their own."""
import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["src/qkv/torch/*.py"]
