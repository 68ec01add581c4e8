"""Write a directory whole or not at all: build it in a sibling temporary directory,
then rename that into place. A crash never leaves a half-written directory that looks
complete. Used for the tiny model (`testbed/tiny_model.py`) and the emulated one
(`testbed/model_dir.py`)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """The directory to fill; on a clean exit it replaces `target`, else it is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a model is not a secret
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
