"""The start-up checks of ``kvtier serve`` beside the free port: a writable data directory,
and a fleet node's name."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.format.errors import InvalidRequest

if TYPE_CHECKING:
    from services.server.config import ServerConfig


def check_node_name(config: ServerConfig) -> None:
    """InvalidRequest when a fleet node (shared metadata) would serve under the default
    name of every node that picks its port (host:0)."""
    if config.metadata == "shared" and not config.node_id \
            and not config.listen.startswith("unix:") and config.port == 0:
        raise InvalidRequest("metadata = 'shared' with listen port 0 needs node_id: "
                             "nodes of a fleet must have distinct names")


def prepare_data_dir(path: Path, *, create: bool = True) -> None:
    """Check that files can be made in the data directory (creating it unless ``create``
    is False: then its nearest existing parent is checked), so a wrong one is refused by
    name at start-up rather than by whichever tier touches it first."""
    probe = path
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        else:
            while not probe.exists() and probe.parent != probe:
                probe = probe.parent
            if not probe.is_dir():
                raise NotADirectoryError(str(probe))
        with tempfile.TemporaryFile(dir=probe):
            pass
    except (FileExistsError, NotADirectoryError) as exc:
        raise InvalidRequest(f"data_dir {path} is not a directory (it or a parent is a "
                             "file): choose a directory for data_dir") from exc
    except OSError as exc:
        raise InvalidRequest(f"data_dir {path} cannot be written ({exc.strerror}): fix its "
                             "permissions or choose another data_dir") from exc
