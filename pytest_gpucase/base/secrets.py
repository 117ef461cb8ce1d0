"""Secrets told by their shape, removed from text: what ``gpucase request`` and the
Recorder share (``tools.scrub`` adds what identifies people and machines; ``verdict.failure``
shapes a message without them, so that a message the capture scrubbed is the same failure
as the raw one).

Every pattern below is linear: a repeat is bounded, or starts only where a run of its
characters starts (a lookbehind), and no two repeats over the same characters touch.
"""

from __future__ import annotations

import functools
import re

__all__ = ["LOCAL_HOSTS", "SECRET", "looks_secret", "remove_secrets"]

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
# The forms without an assignment sign, each with what says a secret follows: the form alone
# ("always": an Authorization header, a --password flag), or the name (a variable's,
# HF_TOKEN, PGPASSWORD, hf_token: "name"; a netrc line: "netrc"); else only a value that
# reads as a secret does ("TOKEN or KEY", "turns XPASS when", "a one-key object").
_SECRETS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Authorization: Basic dXNlcjpwYXNz, Bearer ..., token ...: the scheme stays.
    (re.compile(r"(?i)\b((?:proxy-)?authorization[\"']?[ \t]{0,8}[:=][ \t]{0,8}[\"']?"
                r"(?:(?:basic|bearer|token|digest|negotiate)[ \t]{1,8})?)" + _VALUE), "always"),
    (re.compile(r"(?i)\b(bearer[ \t]{1,8})" + _VALUE), "always"),
    # HF_TOKEN secret123, PGPASSWORD hunter2: with a space only, the name must read as a
    # variable (upper case), so that prose ("token ids") is left alone.
    (re.compile(rf"(?<!{_NAME_CHARS})((?=[A-Z0-9_]{{0,64}}{_SECRET_WORD_UPPER})"
                r"[A-Z0-9_]{1,128}[ \t]{1,8})" + _VALUE), "name"),
    (re.compile(rf"(?i)(?<=[_-])((?:{_SECRET_NAMES}|key)[ \t]{{1,8}})" + _VALUE), "name"),
    # netrc: machine host login me password hunter2.
    (re.compile(r"(?i)(?<![\w-])((?:password|passwd|passphrase)[ \t]{1,8})" + _VALUE), "netrc"),
    # --password X, --token=X, -p X (mysql, sshpass): command-line flags that take a secret;
    # -p is pytest's plugin flag too (-p no:cacheprovider): a value that reads as a secret.
    (re.compile(rf"(?<![\w-])((?:--(?:{_SECRET_NAMES}|pass|auth|key)|-p)(?:[ \t]{{1,8}}|=))"
                + _VALUE, re.IGNORECASE), "always"),
)
# A bare run of hex digits (a 40-hex API token, a 32- or 64-hex secret) is a secret only in a
# secret's position, told by the word right before it, in prose as well ("token <hex>", "the
# API key is <hex>", "secret: <hex>"), or by a name whose last segment is AUTH (GITHUB_AUTH=,
# X-Auth:, auth_header:, which the names above miss). Anywhere else it is a git commit's SHA
# or a digest ("[origin] revision", "commit <hex>", GIT_COMMIT=, a cache key): kept.
_HEX_SECRET = re.compile(
    r"(?<![\w-])((?i:tokens?|secrets?|passwords?|passwd|passphrase|credentials?|auth"
    r"|apikey|(?:api|access|secret|private|client|auth)[ _-]?keys?)"
    r"(?:[ \t]{1,8}(?i:is|was)|[ \t]{0,8}[=:])?[ \t]{1,8}"
    r"|(?:[A-Za-z0-9_.-]{0,64}[_.-])?(?i:auth)(?:[_.-]?(?i:header))?"
    r"(?:[\"']?[ \t]{0,8}[=:][ \t]{0,8}|[ \t]{1,8})[\"']?)"
    r"([0-9a-fA-F]{32,128})(?![\w-])")
# A word of prose: what follows a secret's name and a space without being its value.
_WORD = re.compile(r"[a-z]{1,24}")
_NETRC = re.compile(r"(?i)\b(?:login|machine|default)[ \t]{1,8}\S{1,256}[ \t]{1,8}\Z")
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
# Bare words that are a label before a colon or an equals sign only where a line (or a list
# item, a table) starts with them: in prose ("to make it pass: ...", "the primary key: ...",
# "no readable signature: ...") they are words, and only a value that reads as a secret is one.
_BARE_WORDS = frozenset({
    "pass", "passes", "password", "passwords", "passwd", "passphrase", "pwd", "key", "keys",
    "token", "tokens", "secret", "secrets", "signature", "sig", "auth", "credential",
    "credentials", "xpass"})
_LABEL = re.compile(r"([A-Za-z0-9_.-]{1,128})([\"']?)([ \t]{0,8})([=:])([ \t]{0,8})")
_LINE_BEFORE = 64  # characters looked back at for the start of a label's line
# What stands before a label that starts its line: list and table marks, a shell's export.
_LINE_START = re.compile(r"[ \t]{0,16}(?:[-*>#|][ \t]{0,8}){0,4}(?:(?:export|set|ENV)[ \t]{1,8})?"
                         r"[\"'`]?\Z")
# Values that hold no secret whatever names them: a placeholder (<secret>, <pad>, [CLS]),
# a reference to one (${DB_PASS}, $TOKEN, %(token)s), a mask, nothing, a constant.
_NOT_A_VALUE = re.compile(r"<[^\s<>]{0,40}>|<\|[^\s|]{0,40}\|>|\[[^\s\[\]]{0,40}\]"
                          r"|\$\{[^}\s]{1,128}\}|\$[A-Za-z_][A-Za-z0-9_]{0,127}"
                          r"|%\([A-Za-z_]{1,64}\)s|\*{1,64}|\.{3}|(?i:none|null|nil|true|false)|")
_SECRET_SYMBOLS = frozenset("/+=!@#$%^&*~?")
_NUMBER = re.compile(r"[-+]?[0-9]{1,32}(?:\.[0-9]{1,32})?(?:[eE][-+]?[0-9]{1,4})?")
# Names under which a number is a secret too (a PIN, a numeric password); under TOKEN and KEY
# a number is a count or a size (max_tokens, num_keys, key_dim).
_STRICT_NAME = re.compile(r"(?i)pass|pwd|secret|credential|auth|sig")


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
    for pattern, said_by in _SECRETS:
        text = pattern.sub(functools.partial(_spaced, said_by=said_by), text)
    return _HEX_SECRET.sub(_hex_secret, text)


def _hex_secret(found: re.Match[str]) -> str:
    """A run of hex digits after a secret's word, removed when it holds digits and letters
    both (a number, or a word such as "deadbeef...", is not a key)."""
    value = found.group(2)
    if value.isdigit() or not any(c.isdigit() for c in value):
        return found.group(0)
    return found.group(1) + SECRET


def _spaced(found: re.Match[str], said_by: str) -> str:
    """A value after a name and a space (or a flag): removed when it reads as a secret, or
    when the form says a secret follows (``said_by``, as in ``_SECRETS``), or the name does
    and it is no word of prose (lower-case letters: "OPENAI_API_KEY is not set")."""
    value = found.group(0)[len(found.group(1)):]
    if _NOT_A_VALUE.fullmatch(value):
        return found.group(0)
    said = _said(found, said_by)
    if looks_secret(value) or (said and (said_by != "name" or not _WORD.fullmatch(value))):
        return found.group(1) + SECRET
    return found.group(0)   # "OPENAI_API_KEY is not set": a name, then words


def _said(found: re.Match[str], said_by: str) -> bool:
    name = found.group(1).strip()
    start = found.start()
    if said_by == "always":
        return not name.startswith("-p")
    if said_by == "netrc":
        line = found.string[max(0, start - _LINE_BEFORE):start].rpartition("\n")[2]
        return _NETRC.search(line) is not None
    # A variable's name (HF_TOKEN, PGPASSWORD, hf_token), not a bare word (TOKEN, XPASS)
    # nor a hyphenated one (one-key).
    before = found.string[start - 1:start] if start else ""
    return before == "_" or (before != "-" and name.lower() not in _BARE_WORDS)


def _assigned(found: re.Match[str]) -> str:
    quote = found["quote"] or ""
    value = found.group(0)[len(found["lead"]):]
    value = value[1:-1] if quote else value
    if _NOT_A_VALUE.fullmatch(value) or (_NUMBER.fullmatch(value)
                                          and not _STRICT_NAME.search(found["lead"])):
        return found.group(0)   # max_tokens = 512, key_dim: 64: a count, not a key
    if not _labelled(found) and not looks_secret(value, quoted=bool(quote)):
        return found.group(0)
    return f"{found['lead']}{quote}{SECRET}{quote}"


def _labelled(found: re.Match[str]) -> bool:
    """Whether the name before ``=`` or ``:`` says for itself that a secret follows: a quoted
    key ("password": ...), a variable's name (PGPASSWORD, db_pass, apiKey), a shell's
    assignment (HF_TOKEN=...), or a bare word (pass, key, token) that starts its line. A
    bare word in prose ("to make it pass: find where ...") is a word."""
    label = _LABEL.match(found["lead"])
    if label is None or label[2]:
        return True
    name, spaced = label[1], bool(label[3] or label[5])
    if label[4] == "=" and not spaced:
        return True   # TOKEN=x, sig=x: an assignment, in a command line or a query
    if name.lower() not in _BARE_WORDS or (name.isupper() and name.lower() != "xpass"):
        return True
    start = found.start()
    before = found.string[max(0, start - _LINE_BEFORE):start].rpartition("\n")[2]
    # A line of prose wrapped before the word ("to make it\npass: mask the padding") goes on
    # in words after the value; a YAML key's value ends its line.
    after = found.string[found.end():found.end() + 2]
    return _LINE_START.match(before) is not None and re.match(r"[ \t][A-Za-z]", after) is None


def looks_secret(value: str, *, quoted: bool = False) -> bool:
    """Whether a value reads as a secret without a name to say so: letters and digits mixed
    (hunter2, abc123xyz), a symbol words do not hold (/ + = ! @ # $ % ^ & * ~ ?), or a long
    run of both cases; a word ("find", "when", "object"), a number, a phrase in quotes
    ("payload name", "int64 (1, 2)") is none."""
    if quoted and any(c.isspace() for c in value):
        return False
    letters = any(c.isalpha() for c in value)
    if letters and any(c.isdigit() for c in value):
        return True
    if any(c in _SECRET_SYMBOLS for c in value):
        return True
    return len(value) >= 20 and any(c.isupper() for c in value) and any(c.islower() for c in value)


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


