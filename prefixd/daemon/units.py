"""`prefixd install-units`: the shipped systemd units, written with this install's ExecStart.

The units are the files in the repository's `systemd/` (system) and `systemd/user/` (user);
a wheel carries them under `<prefix>/share/prefixd/systemd/`. Only the program of each
`ExecStart=` line changes: its flags stay as shipped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

UNIT_NAMES = ("prefixd.service", "prefixd.socket")
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
_EXEC_RE = re.compile(r"^(ExecStart=)(\S+)", re.MULTILINE)


class UnitsError(RuntimeError):
    """The units cannot be found or written; the message says which and why."""


@dataclass(frozen=True, slots=True)
class InstalledUnits:
    directory: Path
    paths: tuple[Path, ...]
    exec_start: str


def source_dir(user: bool, *, roots: tuple[Path, ...] | None = None) -> Path:
    """The directory holding the shipped units: a source checkout's, else the installed copy."""
    if roots is None:
        roots = (Path(__file__).resolve().parents[2] / "systemd", Path(sys.prefix) / "share" / "prefixd" / "systemd")
    for root in roots:
        directory = root / "user" if user else root
        if all((directory / name).is_file() for name in UNIT_NAMES):
            return directory
    raise UnitsError(f"the shipped units are not in {' or '.join(str(r) for r in roots)}")


def default_exec_start() -> str:
    """The command that runs this prefixd: the `prefixd` script beside this Python, else `python -m`."""
    script = Path(sys.executable).parent / "prefixd"
    if script.is_file() and os.access(script, os.X_OK):
        return _quote(str(script.absolute()))
    found = shutil.which("prefixd")
    if found is not None:
        return _quote(str(Path(found).absolute()))
    return f"{_quote(str(Path(sys.executable).absolute()))} -m prefixd.daemon.cli"


def _quote(word: str) -> str:
    # systemd's ExecStart splits like a shell on unquoted whitespace and reads double quotes
    return word if shlex.quote(word) == word else '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def default_dir(user: bool, env: dict[str, str] | None = None) -> Path:
    """/etc/systemd/system, or $XDG_CONFIG_HOME/systemd/user (~/.config/systemd/user) with --user."""
    if not user:
        return SYSTEM_UNIT_DIR
    env = dict(os.environ) if env is None else env
    config = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user"


def render(text: str, exec_start: str) -> str:
    """`text` with the program of every ExecStart= line replaced by `exec_start`."""
    rendered, count = _EXEC_RE.subn(lambda m: m.group(1) + exec_start, text)
    return rendered if count else text


def install_units(*, user: bool, directory: Path | None = None, exec_start: str | None = None,
                  source: Path | None = None) -> InstalledUnits:
    """Write prefixd.service and prefixd.socket into `directory`; returns what was written."""
    source = source_dir(user) if source is None else source
    directory = default_dir(user) if directory is None else directory
    exec_start = default_exec_start() if exec_start is None else exec_start
    written = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name in UNIT_NAMES:
            path = directory / name
            path.write_text(render((source / name).read_text(), exec_start))
            written.append(path)
    except OSError as e:
        raise UnitsError(f"cannot write the units to {directory}: {e.strerror or e}") from None
    return InstalledUnits(directory, tuple(written), exec_start)


def next_steps(installed: InstalledUnits, user: bool) -> list[str]:
    """What to run after writing the units (printed by the CLI)."""
    ctl = "systemctl --user" if user else "systemctl"
    steps = [f"{ctl} daemon-reload", f"{ctl} enable --now prefixd.socket"]
    if not user:
        steps.insert(0, "useradd --system --home-dir /var/lib/prefixd --shell /usr/sbin/nologin prefixd")
    return steps
