"""Secrets, people and machines removed from text meant to be shared (``gpucase request``).

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_gpucase.case.model import Case
from pytest_gpucase.verdict.triage import bounded

__all__ = ["SECRET", "Scrubber", "remove_secrets"]

# Source files keep their name when their directory is removed from a path: the name of a
# kernel source (Loss.cu) is what an analysis needs, the directories are what identifies.
_SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".c", ".h", ".hpp", ".hip", ".py")
_SCRUBBED = 256 * 1024
SECRET = "<secret>"
# An unquoted value: up to whitespace, a quote, a separator or a backtick (a Markdown code
# span around it stays closed), never starting with = or : (the sign of an assignment is
# not its value). A value already hidden stays one value.
_VALUE = r"(?:<secret>|(?![=:])[^\s\"'`,;<>]{1,4096})"
# A quoted value, whatever it holds but its quote and a line end (a PEM key in JSON is one
# line of \n escapes).
_QUOTED = r"(?P<quote>[\"'])[^\"'\n]{0,16384}(?P=quote)"
_SECRET_NAMES = (r"token|secret|password|passwd|passphrase|api[_-]?key|access[_-]?key|"
                 r"private[_-]?key|client[_-]?secret|credentials?")
# What makes a name a secret's, wherever it stands in the name: PGPASSWORD, MYSQL_PWD,
# DB_PASS, HF_TOKEN, client_secret, AWS_SECRET_ACCESS_KEY, private_key, apiKey, pass
# (YAML). The word ends a segment of the name (an end, a separator, a capital letter):
# "passed: 3", "keyboard" and "tokenizer" are words, not secrets.
_SECRET_WORD = r"(?i:pass(?:word|wd|phrase)?s?|pwd|secrets?|tokens?|keys?)(?![a-z])"
_SECRET_WORD_UPPER = r"(?:PASS(?:WORD|WD|PHRASE)?S?|PWD|SECRETS?|TOKENS?|KEYS?)(?![A-Z])"
_NAME_CHARS = r"[A-Za-z0-9_.-]"
# A name (a run of name characters, starting where one starts) that holds a secret word and
# is not an exception's (KeyError: 'fc.weight' is a message, not a key). The lookaheads
# are bounded, and a name is tried only where a run begins: linear in the text.
_SECRET_NAME = (rf"(?<!{_NAME_CHARS})(?={_NAME_CHARS}{{0,64}}{_SECRET_WORD})"
                rf"(?!(?i:{_NAME_CHARS}{{0,64}}(?:error|exception|warning|interrupt))"
                rf"(?!{_NAME_CHARS})){_NAME_CHARS}{{1,128}}")
# Token shapes that are keys wherever they appear, after a letter or digit only (a token
# after an underscore, "MY_hf_...", is still one): GitHub, GitLab, Slack, AWS access key
# ids, Google, OpenAI / Anthropic, Hugging Face, npm, PyPI, Stripe, SendGrid, Docker Hub,
# NVIDIA, DigitalOcean, Grafana, Replicate, Groq, Shopify, JWT.
_TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{20,255}|github_pat_\w{20,255}"
    r"|gl(?:pat|dt|rt|ptt|ft|soat|sa|cbt)-[\w-]{20,255}|xox[abeoprs]-[\w-]{10,255}"
    r"|xapp-[\w-]{10,255}"
    r"|(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA|ASCA)[0-9A-Z]{16}"
    r"|AIza[\w-]{30,64}|ya29\.[\w-]{20,2048}"
    r"|sk-[\w-]{20,255}|hf_[A-Za-z0-9]{20,255}|npm_[A-Za-z0-9]{30,255}|pypi-[\w-]{40,512}"
    r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,255}|SG\.[\w-]{16,64}\.[\w-]{16,128}"
    r"|dckr_pat_[\w-]{20,255}|nvapi-[\w-]{20,255}|dop_v1_[0-9a-f]{32,128}|glc_[\w=+/-]{20,255}"
    r"|r8_[A-Za-z0-9]{20,255}|gsk_[A-Za-z0-9]{20,255}|shp(?:at|ss|ca|pa)_[0-9a-fA-F]{20,255}"
    r"|eyJ[\w-]{1,4096}\.[\w-]{1,4096}\.[\w-]{0,4096})")
_ASSIGNED = re.compile(
    # PGPASSWORD=x, 'PGPASSWORD': 'x', "db_pass": "x y", MYSQL_PWD = x, pass: x (YAML),
    # sig=... (an Azure SAS), _auth=... and "auth": "..." (npm, docker registries).
    rf"(?P<lead>(?:{_SECRET_NAME}|(?<!{_NAME_CHARS})(?i:sig|[A-Za-z0-9_.-]{{0,64}}signature"
    rf"|_?auth|[A-Za-z0-9_.-]{{0,64}}credentials?)(?!{_NAME_CHARS}))"
    rf"[\"']?[ \t]{{0,8}}[=:][ \t]{{0,8}})(?:{_QUOTED}|{_VALUE})")
_SECRETS = (
    # Authorization: Basic dXNlcjpwYXNz, Bearer ..., token ...: the scheme stays.
    re.compile(r"(?i)\b((?:proxy-)?authorization[\"']?[ \t]{0,8}[:=][ \t]{0,8}[\"']?"
               r"(?:(?:basic|bearer|token|digest|negotiate)[ \t]{1,8})?)" + _VALUE),
    re.compile(r"(?i)\b(bearer[ \t]{1,8})" + _VALUE),
    # HF_TOKEN secret123, PGPASSWORD hunter2: with a space only, the name must read as a
    # variable (upper case), so that prose ("token ids") is left alone.
    re.compile(rf"(?<!{_NAME_CHARS})((?=[A-Z0-9_]{{0,64}}{_SECRET_WORD_UPPER})"
               r"[A-Z0-9_]{1,128}[ \t]{1,8})" + _VALUE),
    re.compile(rf"(?i)(?<=[_-])((?:{_SECRET_NAMES}|key)[ \t]{{1,8}})" + _VALUE),
    # netrc: machine host login me password hunter2.
    re.compile(r"(?i)(?<![\w-])((?:password|passwd|passphrase)[ \t]{1,8})" + _VALUE),
    # --password X, --token=X, -p X (mysql, sshpass): command-line flags that take a secret.
    re.compile(rf"(?<![\w-])((?:--(?:{_SECRET_NAMES}|pass|auth|key)|-p)(?:[ \t]{{1,8}}|=))"
               + _VALUE, re.IGNORECASE),
)
# A PEM block, whole: its header lines, every base64 line (the short last one too), and
# its end line; lines end in newlines or, inside a JSON string, in \n escapes.
_PEM = re.compile(r"-----BEGIN (?P<label>[A-Z0-9 ]{1,64})-----"
                  r"(?:(?:\r?\n|\\n)[ \t]{0,16}(?:[A-Za-z0-9+/=]{1,256}|[A-Za-z-]{1,32}:"
                  r"[^\n\\]{0,512}))*(?:(?:\r?\n|\\n)[ \t]{0,16})?"
                  r"(?:-----END [A-Z0-9 ]{1,64}-----)?")
# scheme://user:password@host:port/path: the user, password, host and path identify; the
# scheme and port do not. Object stores name a bucket where others name a host. The
# credentials run to the last @ of the authority: a password may hold an unencoded / or #.
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,15})://((?:[^\s@\"'<>]{0,256}@){1,8})?"
                  r"(\[[0-9a-f:.]{2,64}\]|[^\s/?#:@\"'<>\[\]]{0,253})(:\d{1,5})?"
                  r"([/?#][^\s\"'<>()\[\]{}]{0,4096})?")
_BUCKETS = ("s3", "s3a", "s3n", "gs", "gcs", "hdfs", "az", "abfs", "abfss", "wasb", "wasbs",
            "oss", "r2")
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
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


def remove_secrets(text: str) -> str:
    """``text`` without secrets, told by their shape rather than by a list of names: PEM
    blocks, URL credentials (with URLs reduced to their scheme and port), token shapes of
    common vendors, values of names that hold PASS, PWD, SECRET, TOKEN or KEY (any case,
    any prefix or suffix), authorization headers, secret flags. Linear in ``text``."""
    text = _PEM.sub(lambda m: f"-----BEGIN {m['label']}-----{SECRET}-----END {m['label']}-----",
                    text)
    text = _URL.sub(_url, text)
    text = _TOKEN_SHAPES.sub(SECRET, text)
    text = _ASSIGNED.sub(_assigned, text)
    for pattern in _SECRETS:
        text = pattern.sub(lambda m: m.group(1) + SECRET, text)
    return text


def _assigned(found: re.Match[str]) -> str:
    quote = found["quote"] or ""
    return f"{found['lead']}{quote}{SECRET}{quote}"


def _url(found: re.Match[str]) -> str:
    scheme, user, host, port, path = found.groups()
    said = f"{scheme}://"
    if user:
        said += "<user>:<secret>@" if ":" in user else "<user>@"
    if scheme.lower() in _BUCKETS:
        said += "<bucket>" if host else ""
    elif host and host.lower() not in _LOCAL_HOSTS:
        said += "<host>"
    else:
        said += host or ""
    said += port or ""
    if path and path not in ("/", "?", "#"):
        said += "/<path>"
    return said


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
        text = _HOST.sub(lambda m: m.group(0) if m.group(0).lower() in _LOCAL_HOSTS
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
