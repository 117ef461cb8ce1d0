"""Secrets, people and machines removed from text meant to be shared (``gpucase request``),
and secrets removed from what the Recorder writes into a case (``capture_text``,
``scrub_data``: the same shapes, ``base.secrets``; the user's home written as ``~``).

Every pattern below is linear: a repeat is bounded, or starts only where a run of its
characters starts (a lookbehind), and no two repeats over the same characters touch; the
text itself is bounded too (``triage.bounded``). A request is pasted into an issue: a case's
stderr of megabytes must not take minutes to clean.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from pytest_gpucase.base.secrets import LOCAL_HOSTS, SECRET, remove_secrets
from pytest_gpucase.case.model import Case
from pytest_gpucase.verdict.triage import bounded

__all__ = ["SECRET", "Scrubber", "capture_text", "remove_secrets", "scrub_data",
           "secret_field"]

# Source files keep their name when their directory is removed from a path: the name of a
# kernel source (Loss.cu) is what an analysis needs, the directories are what identifies.
_SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".c", ".h", ".hpp", ".hip", ".py")
_SCRUBBED = 256 * 1024
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){1,8}")
# Host names outside a URL are told from dotted Python names by their last label; suffixes
# that are also file extensions or attributes (.py, .cu, .pt, .io, .to, .in, .sh) are left out.
_HOST = re.compile(
    r"(?<![\w.-])(?:[A-Za-z0-9-]{1,63}\.){1,8}(?:com|net|org|edu|gov|mil|int|info|biz|dev|app|"
    r"cloud|ai|co|us|uk|de|fr|nl|eu|ch|jp|cn|kr|ru|br|ca|au|se|fi|internal|local|localdomain|"
    r"lan|corp|intra|intranet|home|arpa|cluster|private|svc)(?![\w.-])", re.IGNORECASE)
_IP_CANDIDATE = re.compile(r"(?<![\w.:])(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f:]{2,39})(?![\w.:])")
# A long run of letters and digits (base64, hex) is a key or a hash, not a word; applied
# after paths are replaced, which it would otherwise take for keys.
_LONG_TOKEN = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/=-]{32,}(?![A-Za-z0-9+/=_-])")
_HOMES = re.compile(r"(?:/home|/Users)/[^/\s:'\"`]{1,256}|/root(?![\w.-])"
                    r"|[A-Za-z]:\\Users\\[^\\\s]{1,256}")
# Absolute paths, and paths below a home once it reads "~": the directories identify people.
_ABSOLUTE = re.compile(r"(?<![\w.:/~<>-])/[^\s:'\"`,;()\[\]{}<>]{1,4096}"
                       r"|~[/\\][^\s:'\"`,;()\[\]{}<>]{1,4096}|(?<![\w])[A-Za-z]:\\[^\s:'\"`,;]{1,4096}")


def _ip(found: re.Match[str]) -> str:
    import ipaddress

    text = found.group(0)
    if ":" in text and sum(1 for group in text.split(":") if group) < 3:
        return text   # c10::add, 16:00: a C++ name or a time, not an address worth hiding
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    return text if address.is_loopback or address.is_unspecified else "<ip>"


def _long_token(found: re.Match[str]) -> str:
    token = found.group(0)
    digit = any(c.isdigit() for c in token)
    letter = any(c.isalpha() for c in token)
    return "<secret>" if digit and letter else token


@dataclass(frozen=True)
class Scrubber:
    """Removes what identifies people and machines from text meant to be shared."""

    case_dir: str
    home: str
    users: tuple[str, ...]
    hosts: tuple[str, ...]
    ids: tuple[str, ...]

    @classmethod
    def here(cls, case: Case, ids: Sequence[object]) -> Scrubber:
        users = {os.environ.get(name, "") for name in ("USER", "LOGNAME", "USERNAME")}
        # No user name to be found is no user name to leak.
        with contextlib.suppress(OSError, KeyError, ImportError):
            users.add(getpass.getuser())
        home = os.path.expanduser("~")
        users.add(Path(home).name)
        hosts = set()
        with contextlib.suppress(OSError):
            host = socket.gethostname()  # never getfqdn: it may wait on DNS
            hosts |= {host, host.split(".")[0]}
        # A one-letter name would match ordinary text; longer ones are matched as whole words.
        return cls(
            case_dir=str(case.path.resolve()),
            home=home if home not in ("", "/") else "",
            users=tuple(sorted((u for u in users if len(u) >= 2), key=len, reverse=True)),
            hosts=tuple(sorted((h for h in hosts if len(h) >= 2), key=len, reverse=True)),
            ids=tuple(sorted({str(i) for i in ids if len(str(i)) >= 3}, key=len, reverse=True)),
        )

    def scrub(self, text: str) -> str:
        """``text`` without sample ids, paths, homes, e-mail addresses, secrets, users, hosts."""
        text = bounded(text, _SCRUBBED)
        text = self._without_ids(text)
        # Exact strings first, before any pattern can cut through them.
        if self.case_dir:
            text = text.replace(self.case_dir + os.sep, "").replace(self.case_dir, ".")
        if self.home:
            text = re.sub(rf"{re.escape(self.home)}(?![\w.-])", "~", text)
        text = remove_secrets(text)
        text = _EMAIL.sub("<email>", text)
        text = _IP_CANDIDATE.sub(_ip, text)
        text = _HOST.sub(lambda m: m.group(0) if m.group(0).lower() in LOCAL_HOSTS
                         else "<host>", text)
        text = _HOMES.sub("~", text)
        text = _ABSOLUTE.sub(_path_placeholder, text)
        text = _LONG_TOKEN.sub(_long_token, text)
        for user in self.users:
            text = re.sub(rf"(?<![\w]){re.escape(user)}(?![\w])", "<user>", text)
        for host in self.hosts:
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "<host>", text)
        return text

    def _without_ids(self, text: str) -> str:
        """Sample ids replaced in one pass over the words, however many ids there are."""
        words = {sample for sample in self.ids if re.fullmatch(r"\w+", sample)}
        if words:
            text = re.sub(r"\w+", lambda m: "<sample id>" if m.group(0) in words
                          else m.group(0), text)
        # Ids with other characters are few (file names, "a-1"): one exact search each.
        for sample in [sample for sample in self.ids if sample not in words][:_MAX_ODD_IDS]:
            text = re.sub(rf"(?<![\w]){re.escape(sample)}(?![\w])", "<sample id>", text)
        return text


_MAX_ODD_IDS = 256


def _path_placeholder(match: re.Match[str]) -> str:
    path = match.group(0)
    name = re.split(r"[/\\]", path)[-1]
    return f"<path>/{name}" if name.endswith(_SOURCE_SUFFIXES) else "<path>"


# The segments of a field's name that say it holds a secret (``wandb_api_key``,
# ``hub_token``, ``dbPassword``, ``client_secret``); a name is cut into segments at
# separators and where a capital follows a small letter.
_SECRET_SEGMENTS = frozenset({
    "pass", "password", "passwd", "passphrase", "pwd", "secret", "secrets", "token", "tokens",
    "key", "keys", "apikey", "credential", "credentials", "auth", "signature", "sig"})
_SEGMENT = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")
# A tokenizer's special tokens (``pad_token = "<pad>"``, ``"[CLS]"``) are words, not secrets.
_SPECIAL_TOKEN = re.compile(r"<[^\s<>]{0,30}>|\[[^\s\[\]]{0,30}\]|<\|[^\s|]{0,30}\|>")


def capture_text(text: str) -> str:
    """Text the Recorder writes into a case (summary, xfail line, ``[origin]``, stderr,
    sample ids) without secrets (``base.secrets``: URLs keep their host and path, a sample id
    needs them) and with the user's home written as ``~``."""
    text = remove_secrets(text, urls="keep")
    home = os.path.expanduser("~")
    if home not in ("", "/", "~") and home in text:
        text = re.sub(rf"{re.escape(home)}(?![\w.-])", "~", text)
    return text


def secret_field(name: str, value: object) -> bool:
    """Whether a field (a hyperparameter, a config entry, an argument) holds a secret by its
    name: text under a name with a secret's segment (``api_key``, ``hub_token``); numbers,
    booleans and a tokenizer's special tokens (``pad_token = "<pad>"``) are none."""
    if not isinstance(value, str) or not value or value == SECRET:
        return False
    if _SPECIAL_TOKEN.fullmatch(value):
        return False
    return any(part.lower() in _SECRET_SEGMENTS for part in _SEGMENT.split(name) if part)


def scrub_data(data: Any, removed: list[str], where: str = "", *,
               fields: bool = True) -> Any:
    """``data`` (JSON or TOML values) without secrets: each text without its secrets
    (``capture_text``), and with ``fields`` (hyperparameters, a config: not the names of
    a call's inputs, ``tokens = "int64 (1, 2)"``) each field whose name says it holds a
    secret replaced by ``SECRET``; the dotted place of each change is added to ``removed``."""
    if isinstance(data, Mapping):
        table = {}
        for key, value in data.items():
            place = f"{where}.{key}" if where else str(key)
            if fields and secret_field(str(key), value):
                removed.append(place)
                table[key] = SECRET
            else:
                table[key] = scrub_data(value, removed, place, fields=fields)
        return table
    if isinstance(data, list | tuple):
        items = [scrub_data(value, removed, f"{where}[{i}]", fields=fields)
                 for i, value in enumerate(data)]
        return type(data)(items) if isinstance(data, tuple) else items
    if isinstance(data, str):
        text = capture_text(data)
        if text != data:
            removed.append(where or "text")
        return text
    return data
