"""The scrubber against the tool's own words: every text the package writes (triage advice,
messages, notes, errors) and every prose paragraph of the README and docs/ goes through
unchanged, and secrets of every common shape are still removed."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_gpucase.base.secrets import SECRET, remove_secrets
from pytest_gpucase.tools.scrub import Scrubber, capture_text
from pytest_gpucase.verdict import triage

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_gpucase"
# The scrubber's own sources quote the shapes it removes.
_QUOTES_SECRETS = {"base/secrets.py", "tools/scrub.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _written(path: Path) -> Iterator[str]:
    """The texts a module writes: its string literals and f-strings (a field read as "3"),
    docstrings and one-word strings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    inner = {id(value) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
             for value in node.values}
    for node in ast.walk(tree):
        if id(node) in skip or id(node) in inner:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(str(part.value) if isinstance(part, ast.Constant) else "3"
                           for part in node.values)
        else:
            continue
        if text.count(" ") >= 2:
            yield text


def _package_texts() -> list[tuple[str, str]]:
    texts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where not in _QUOTES_SECRETS:
            texts += [(where, text) for text in _written(path)]
    return texts


def _triage_texts() -> list[str]:
    texts = [triage._RESTART, triage._CPU_HINT]
    for rule in triage._RULES:
        texts += [rule.clue, rule.first_check, rule.avoid, *rule.notes,
                  *(template for _, template in rule.details)]
    texts += [meaning for _, meaning in triage._ASSERTION_MEANINGS]
    for message in ("index out of range in self", "Target 19 is out of bounds.",
                    "CUDA error: device-side assert triggered", "CUDA out of memory.",
                    "Function 'LogBackward0' returned nan values in its 0th output."):
        found = triage.triage("RuntimeError", message)
        assert found is not None
        texts.append(found.render())
    return texts


def _prose(markdown: str) -> Iterator[str]:
    """The paragraphs of a Markdown page outside code blocks, inline code spans taken out
    (they quote the very shapes the scrubber removes)."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines.append("")
        elif not fenced:
            lines.append(re.sub(r"`[^`]*`", "code", line))
    yield from (paragraph for paragraph in re.split(r"\n[ \t]*\n", "\n".join(lines))
                if paragraph.strip())


def _docs_texts() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(page.name, paragraph) for page in pages
            for paragraph in _prose(page.read_text(encoding="utf-8"))]


_ANONYMOUS = Scrubber(case_dir="/nonexistent/case", home="/nonexistent/home", users=(),
                      hosts=(), ids=())


def test_the_corpus_is_the_tools_own_words() -> None:
    texts = [text for _, text in _package_texts()]
    assert len(texts) > 1000
    assert any("to make it pass: find where" in text for text in texts)
    assert len(_docs_texts()) > 200


def test_triage_advice_goes_through_every_scrubber_unchanged() -> None:
    """What ``gpucase request`` prints (the full scrubber) and what a case keeps."""
    for text in _triage_texts():
        assert _ANONYMOUS.scrub(text) == text
        assert capture_text(text) == text
        assert remove_secrets(text) == text


def test_every_text_the_package_writes_has_no_secret_to_remove() -> None:
    changed = [(where, text, remove_secrets(text, urls="keep"))
               for where, text in _package_texts() if remove_secrets(text, urls="keep") != text]
    assert not changed, "\n".join(f"{where}: {text!r}\n  -> {after!r}"
                                  for where, text, after in changed[:10])


def test_no_prose_paragraph_of_the_docs_has_a_secret_to_remove() -> None:
    changed = [(where, text, capture_text(text)) for where, text in _docs_texts()
               if capture_text(text) != text]
    assert not changed, "\n".join(f"{where}: {text!r}\n  -> {after!r}"
                                  for where, text, after in changed[:10])


@pytest.mark.parametrize("text", [
    "Do not clamp the indices or enlarge the layer to make it pass: find where the value was made",
    "avoid: Do not clamp the input to make it pass: find where",
    "the layout, not the key: a view's stride",
    "XFAIL while the NaN is there, and turns XPASS when\nthe fix removes it",
    "PASS, PWD, SECRET, TOKEN or KEY (any case)",
    "a node is a one-key object, not a list",
    "the constructor of Foo has no readable signature: no parameters",
    "a table of dict key = \"payload name\", as capture writes it",
    "pytest -p no:cacheprovider -p xdist",
    "max_tokens = 512, key_dim: 64, num_keys=8",
    "Prose is left alone: \"to make it\npass: mask the padding\" keeps its words.",
    "pad_token = \"<pad>\", cls_token: [CLS], password: ${DB_PASSWORD}, token=$HF_TOKEN",
    "password: <secret>",
    "RuntimeError: OPENAI_API_KEY is not set; HF_TOKEN not found in the environment",
    "the MY_KEY value and a password holding a slash",
])
def test_prose_and_placeholders_stay(text: str) -> None:
    assert remove_secrets(text) == text
    assert _ANONYMOUS.scrub(text) == text


@pytest.mark.parametrize(("text", "kept"), [
    # API keys of the common vendors, wherever they stand.
    ("key sk-proj-T3BlbkFJabcdefghijklmnop0123 failed", "key <secret> failed"),
    ("using hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123 now", "using <secret> now"),
    ("AKIAIOSFODNN7EXAMPLE in the log", "<secret> in the log"),
    ("ghp_0123456789abcdefghijABCDEFGHIJ0123", "<secret>"),
    # Assignments, flags and config dumps, whatever word the value is.
    ("password=hunter", "password=<secret>"),
    ("PASSWORD=correcthorse make deploy", "PASSWORD=<secret> make deploy"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     "aws_secret_access_key = <secret>"),
    ("config: {'lr': 0.1, 'token': 'abcdefgh', 'hub_token': 'plainword'}",
     "config: {'lr': 0.1, 'token': '<secret>', 'hub_token': '<secret>'}"),
    ("  token: abcdefgh\n  password: hunter\n  wandb_api_key: something",
     "  token: <secret>\n  password: <secret>\n  wandb_api_key: <secret>"),
    ("db_password: 1234 and PIN", "db_password: <secret> and PIN"),
    ("the run failed, token: tk_9f8e7d6c", "the run failed, token: <secret>"),
    ("mysql -u root --password plain", "mysql -u root --password <secret>"),
    ("sshpass -p hunter2 ssh", "sshpass -p <secret> ssh"),
    ("HF_TOKEN secret123 was set", "HF_TOKEN <secret> was set"),
    ("PGPASSWORD Tr0ub4dor psql", "PGPASSWORD <secret> psql"),
    ("machine db login me password hunter", "machine db login me password <secret>"),
    ("Authorization: Bearer abcdef", "Authorization: Bearer <secret>"),
    # URLs with credentials, private keys.
    ("https://alice:hunter@example.com/repo", "https://<user>:<secret>@<host>/<path>"),
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkq\nhkiG9w0B\n-----END PRIVATE KEY-----",
     "-----BEGIN PRIVATE KEY-----<secret>-----END PRIVATE KEY-----"),
])
def test_real_secrets_are_still_removed(text: str, kept: str) -> None:
    assert remove_secrets(text) == kept
    assert SECRET in capture_text(text)


_HEX = "4f9e2c1a8b7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f"


@pytest.mark.parametrize(("text", "kept"), [
    (f"token {_HEX}", "token <secret>"),
    (f"the API key is {_HEX}, rotate it", "the API key is <secret>, rotate it"),
    (f"using Token {_HEX} for the hub", "using Token <secret> for the hub"),
    (f"secret: {_HEX}", "secret: <secret>"),
    (f"apikey {_HEX}", "apikey <secret>"),
    (f"export GITHUB_AUTH={_HEX}", "export GITHUB_AUTH=<secret>"),
    (f"X-Auth: {_HEX.upper()}", "X-Auth: <secret>"),
    (f"auth_header: '{_HEX}'", "auth_header: '<secret>'"),
])
def test_a_bare_hex_token_in_a_secret_s_position_is_removed(text: str, kept: str) -> None:
    assert remove_secrets(text) == kept
    assert capture_text(text) == kept


@pytest.mark.parametrize("text", [
    f'revision = "{_HEX}"',
    f"[origin]\nrevision = \"{_HEX}\"\n",
    f"commit {_HEX}",
    f"git checkout {_HEX} && pytest",
    f"HEAD is now at {_HEX} fix the loss",
    f"tokenizer revision {_HEX}",
    f"the reference cache key {_HEX} was stale",
    f"token {'1' * 40}",
    f"GIT_COMMIT={_HEX} author={_HEX}",
    f"X-Upstream-Commit: {_HEX}",
    f"commit_sha: {_HEX}, authored_by: {_HEX}",
])
def test_a_git_sha_or_digest_is_kept(text: str) -> None:
    assert remove_secrets(text) == text
    assert capture_text(text) == text
