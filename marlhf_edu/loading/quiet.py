"""Loading without noise: transformers' load reports for the mismatches that are expected (`quiet_loading`),
and a module's own progress bar switched off for a block (`no_progress_bar`)."""

from __future__ import annotations

import contextlib


class quiet_loading:
    """Silence transformers' load reports for the expected mismatches (a causal-LM checkpoint loaded as a bare
    backbone drops `lm_head`; a classifier built on it gets a fresh `score` that the adapter then replaces)."""

    def __enter__(self):
        from transformers.utils import logging

        self._level = logging.get_verbosity()
        logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self._level)
        return False


@contextlib.contextmanager
def no_progress_bar(module_name: str):
    """Inside the block, `module_name`'s own `tqdm` draws nothing (unchanged if the module has none)."""
    import functools
    import importlib

    module = importlib.import_module(module_name)
    bar = getattr(module, "tqdm", None)
    if bar is None:
        yield
        return
    module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        module.tqdm = bar
