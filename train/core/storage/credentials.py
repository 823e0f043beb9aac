"""Credentials stay out of the config, and out of everything printed.

A config is copied everywhere: ``RUN_DIR/config.yaml``, every checkpoint, the trackers'
params and their config.yaml artifact, TensorBoard's text tab, the workers' command
line (``key=value`` overrides, visible to ``ps``) and a later resume's "config differs"
warning. So a value that carries a credential is refused when a config is loaded
(:func:`found`; exit 2, one line naming where the credential goes instead), whichever
key holds it:

- a URL with a user or password (``http://user:token@host``), or with a credential in
  its query or fragment (``?token=``, ``X-Amz-Signature=``), in any string value;
- a key of ``model.args`` or ``data.args`` named like a credential (``password``,
  ``api_key``, ``hf_token``, ``client_secret``) that holds a value.

Credentials come from environment variables only: MLflow's own
(``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``, or a whole
``MLFLOW_TRACKING_URI``), W&B's ``WANDB_API_KEY``, ``checkpoint.remote``'s object store
the standard AWS chain's (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``
and the shared files, web identity; ``s3://KEY:SECRET@bucket`` is refused like any URL
with a user), and for your own code whatever it reads (``HF_TOKEN``).

What is printed still passes :func:`redacted`, the one function that hides them (in
every error, warning and log line, through :func:`train.core.errors.printable`): a URL's
user and password become ``***@`` and a credential's value in its query ``***``; a
credential-named key's value in a mapping, ``***``. That covers what the refusal cannot:
a tracking URI given in ``MLFLOW_TRACKING_URI``, MLflow's own messages, and a run
directory whose config.yaml an older version wrote with a password in it.
"""

from __future__ import annotations

import re
from typing import Any

HIDDEN = "***"
# a URL: scheme://, then up to a space or a quote (as a message, JSON or a repr quotes it)
URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# name=value in a URL's query or fragment (OAuth puts access_token= in the fragment)
PARAM = re.compile(r"([?&#;])([^=&#;]+)=([^&#;]*)")
FREE_FORM = ("model.args", "data.args")  # the only keys whose names the user chooses

# The words (of a name split at _, -, . and camelCase) that make it a credential's: the
# last word, or the last two. ``token`` alone is a credential's name, but the special
# tokens of a tokenizer (pad_token, eos_token) are not: only these owners make one.
LAST_WORDS = {"password", "passwd", "passphrase", "pwd", "secret", "credential",
              "credentials", "apikey", "accesskey", "secretkey", "privatekey", "authtoken",
              "accesstoken", "apitoken"}
KEY_OWNERS = {"api", "access", "secret", "private", "auth", "client", "account",
              "subscription", "master", "signing", "encryption"}
TOKEN_OWNERS = {"api", "auth", "access", "bearer", "refresh", "session", "security", "id",
                "oauth", "hf", "huggingface", "github", "gh", "gitlab", "wandb", "mlflow",
                "secret", "personal", "client", "user", "service", "sas", "jwt", "csrf"}
# only in a URL's query: ?key= (an API key), ?sig= (Azure SAS), X-Amz-Signature=
QUERY_WORDS = {"key", "sig", "signature"}


def words(name: str) -> list[str]:
    """``hfToken`` -> [hf, token]; ``X-Amz-Signature`` -> [x, amz, signature]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(name))
    return [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]


def credential_name(name: str, *, query: bool = False) -> bool:
    """Whether ``name`` names a credential (``api_key``, ``hf_token``, ``password``);
    query: as the name of a URL's query parameter, where ``key`` and ``sig`` are too."""
    parts = words(name)
    if not parts:
        return False
    last, before = parts[-1], parts[-2] if len(parts) > 1 else None
    if last == "token":
        return before is None or before in TOKEN_OWNERS
    if last in LAST_WORDS or (query and last in QUERY_WORDS):
        return True
    return last == "key" and before in KEY_OWNERS


def _filled(value: Any) -> bool:
    """A value a credential could be (not None, a flag or empty)."""
    return value not in (None, "", [], {}) and not isinstance(value, bool)


def _url(url: str) -> tuple[str, list[str]]:
    """``url`` without its credentials, and what they were (to say so)."""
    scheme, _, rest = url.partition("://")
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0] or [len(rest)])
    authority, tail = rest[:end], rest[end:]
    found = []
    if "@" in authority:
        found.append("a user or password")
        authority = f"{HIDDEN}@{authority.rpartition('@')[2]}"

    def param(match: re.Match) -> str:
        sep, name, value = match.groups()
        if value and value != HIDDEN and credential_name(name, query=True):
            found.append(f"{name}= in its query")
            return f"{sep}{name}={HIDDEN}"
        return match.group(0)
    cut = min([i for i in (tail.find("?"), tail.find("#")) if i >= 0] or [len(tail)])
    tail = tail[:cut] + PARAM.sub(param, tail[cut:])
    return f"{scheme}://{authority}{tail}", found


def redacted(value: Any) -> Any:
    """``value`` with no credential in it: a URL's user and password shown as ``***@``,
    a credential in its query as ``name=***``, anywhere in a text; in a mapping, the
    value of a credential-named key as ``***`` (lists and mappings are walked). The one
    function that hides credentials in what is printed."""
    if isinstance(value, str):
        return URL.sub(lambda m: _url(m.group(0))[0], value) if "://" in value else value
    if isinstance(value, dict):
        return {k: HIDDEN if credential_name(k) and _filled(v) else redacted(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value)
    return value


def found(tree: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, what it holds) for each credential in a config's values (the plain
    data of :func:`~train.core.config.schema.to_dict`): a URL with one, anywhere; a
    credential-named key with a value, under :data:`FREE_FORM`. One inside a list is
    named by the list's key (``model.args.servers: [0].password is named like ...``)."""
    out: list[tuple[str, str]] = []
    for name, value in tree.items():
        _walk(value, f"{prefix}{name}", False, out)
    said = []
    for path, what in out:
        key, bracket, rest = path.partition(".[")
        said.append((key, f"[{rest.replace('.[', '[')} {what}" if bracket else what))
    return said


def _walk(value: Any, dotted: str, free: bool, out: list[tuple[str, str]]) -> None:
    free = free or dotted in FREE_FORM
    if isinstance(value, dict):
        for name, inner in value.items():
            if free and credential_name(name) and _filled(inner):
                out.append((f"{dotted}.{name}", "is named like a credential"))
            else:
                _walk(inner, f"{dotted}.{name}", free, out)
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            _walk(inner, f"{dotted}.[{i}]", free, out)
    elif isinstance(value, str) and "://" in value:
        for url in URL.findall(value):
            what = _url(url)[1]
            if what:
                out.append((dotted, f"holds a URL with {what[0]}, {redacted(url)}"))
                return


# Where each key's credential goes instead (keys not named: your code's own variable)
INSTEAD = {
    "logging.mlflow.tracking_uri": "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                                   "(or MLFLOW_TRACKING_TOKEN) and give the URI without it, "
                                   "or the whole URI in MLFLOW_TRACKING_URI",
}
ELSEWHERE = "have your code read it from an environment variable (e.g. HF_TOKEN)"
COPIED = "a config is copied into config.yaml, checkpoints, trackers and argv"


def problem(key: str, what: str) -> str:
    """The one line a credential in ``key`` is refused with (exit 2): what it is, why,
    and the environment variable it goes in instead."""
    return f"{what}; {COPIED}: {INSTEAD.get(key, ELSEWHERE)}"
