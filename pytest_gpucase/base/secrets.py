"""Secrets told by their shape, removed from text: what ``gpucase request`` and the
Recorder share (``tools.scrub`` adds what identifies people and machines; ``verdict.failure``
shapes a message without them, so that a message the capture scrubbed is the same failure
as the raw one).

Every pattern below is linear: a repeat is bounded, or starts only where a run of its
characters starts (a lookbehind), and no two repeats over the same characters touch.
"""

from __future__ import annotations

import re

__all__ = ["LOCAL_HOSTS", "SECRET", "remove_secrets"]

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
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,15})://((?:[^\s@\"'<>]{0,256}@){1,8}"
                  r"|<user>(?::<secret>)?@)?"  # credentials removed already: the same URL
                  r"(\[[0-9a-f:.]{2,64}\]|[^\s/?#:@\"'<>\[\]]{0,253})(:\d{1,5})?"
                  r"([/?#][^\s\"'<>()\[\]{}]{0,4096})?")
_BUCKETS = ("s3", "s3a", "s3n", "gs", "gcs", "hdfs", "az", "abfs", "abfss", "wasb", "wasbs",
            "oss", "r2")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
# Bare words that are a label before a colon only where a line (or a list item, a table)
# starts with them: in prose ("to make it pass: ...", "the primary key: ...") they are words.
_BARE_WORDS = frozenset({"pass", "passes", "key", "keys", "token", "tokens", "secret",
                         "secrets"})
_LABEL = re.compile(r"([A-Za-z0-9_.-]{1,128})([\"']?)[ \t]{0,8}([=:])")
_LINE_BEFORE = 64  # characters looked back at for the start of a label's line


def remove_secrets(text: str, *, urls: str = "reduce") -> str:
    """``text`` without secrets, told by their shape rather than by a list of names: PEM
    blocks, URL credentials (with URLs reduced to their scheme and port), token shapes of
    common vendors, values of names that hold PASS, PWD, SECRET, TOKEN or KEY (any case,
    any prefix or suffix), authorization headers, secret flags. Linear in ``text``.

    ``urls="keep"`` keeps a URL's host and path (a case's sample ids and messages need them)
    and removes only its credentials (``user:password@``) and its secret query values
    (``X-Amz-Signature=``, ``sig=``, ``token=``)."""
    text = _PEM.sub(lambda m: f"-----BEGIN {m['label']}-----{SECRET}-----END {m['label']}-----",
                    text)
    text = _URL.sub(_url if urls == "reduce" else _url_kept, text)
    text = _TOKEN_SHAPES.sub(SECRET, text)
    text = _ASSIGNED.sub(_assigned, text)
    for pattern in _SECRETS:
        text = pattern.sub(lambda m: m.group(1) + SECRET, text)
    return text


def _assigned(found: re.Match[str]) -> str:
    if _prose(found):
        return found.group(0)
    quote = found["quote"] or ""
    return f"{found['lead']}{quote}{SECRET}{quote}"


def _prose(found: re.Match[str]) -> bool:
    """Whether a bare word before a colon (``pass:``, ``key:``) is prose, not a label: a word
    stands before it on its line, and it is not quoted."""
    label = _LABEL.match(found["lead"])
    if label is None or label[2] or label[3] != ":" or label[1].lower() not in _BARE_WORDS:
        return False
    start = found.start()
    before = found.string[max(0, start - _LINE_BEFORE):start]
    before = before.rpartition("\n")[2]
    if before.endswith(("'", '"')) or re.search(r"\w", before) is None:
        return False
    # A word after it ("pass: mask the padding", "key: 3") is prose; a value that reads as
    # a key (letters and digits mixed, or a long run) is a secret wherever it stands.
    value = found.group(0)[len(found["lead"]):].strip("'\"")
    return not (len(value) >= 16 or (re.search(r"[A-Za-z]", value) is not None
                                      and re.search(r"\d", value) is not None))


def _url_kept(found: re.Match[str]) -> str:
    """A URL with its credentials removed, its host and path kept."""
    scheme, user, host, port, path = found.groups()
    said = f"{scheme}://"
    if user:
        said += "<user>:<secret>@" if ":" in user else f"{user}"
    return said + (host or "") + (port or "") + (path or "")


def _url(found: re.Match[str]) -> str:
    scheme, user, host, port, path = found.groups()
    said = f"{scheme}://"
    if user:
        said += "<user>:<secret>@" if ":" in user else "<user>@"
    if scheme.lower() in _BUCKETS:
        said += "<bucket>" if host else ""
    elif host and host.lower() not in LOCAL_HOSTS:
        said += "<host>"
    else:
        said += host or ""
    said += port or ""
    if path and path not in ("/", "?", "#"):
        said += "/<path>"
    return said


