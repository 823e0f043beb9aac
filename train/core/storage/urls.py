"""``s3://`` URLs: ``checkpoint.remote``'s ``s3://BUCKET/PREFIX`` (the run's checkpoints go
under ``PREFIX/RUN_NAME/checkpoints/``) and the bucket names every object URL holds.

A malformed URL is bad input (exit 2, from the config checks); credentials never appear
in one (the config checks refuse ``s3://key:secret@``, :mod:`.credentials`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# S3's bucket naming rules (3-63 characters of lowercase letters, digits, dots and hyphens,
# starting and ending with a letter or digit); compatible stores accept a subset of these
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class RemoteURL:
    bucket: str
    prefix: str                 # without leading or trailing '/', may be empty

    def run_prefix(self, run_name: str) -> str:
        """The run's own folder in the bucket: PREFIX/RUN_NAME."""
        return f"{self.prefix}/{run_name}" if self.prefix else run_name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse(url: str) -> tuple[RemoteURL | None, str | None]:
    """(the URL, None) or (None, what is wrong with it)."""
    allowed = "an s3://BUCKET/PREFIX URL (e.g. s3://my-bucket/checkpoints), or empty for off"
    if not url.startswith("s3://"):
        return None, f"{url!r} is not an s3:// URL; {allowed}"
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not BUCKET.match(bucket) or ".." in bucket:
        return None, f"{url!r}: bucket {bucket!r} is not a valid bucket name; {allowed}"
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        return None, f"{url!r}: the prefix has an empty, '.' or '..' part; {allowed}"
    if any(c in prefix for c in "?#\\") or not prefix.isprintable():
        return None, f"{url!r}: the prefix has '?', '#', '\\' or control characters; {allowed}"
    return RemoteURL(bucket, prefix), None
