"""Servers the remote-tier tests share: a real redis-server and moto's S3 server on loopback (ports chosen by the
OS), one per module, and the fake AWS credentials moto takes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from kvtier.localservers import S3_TEST_CREDENTIALS, LocalServer, redis_server, s3_server


@pytest.fixture
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in S3_TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(scope="module")
def rserver() -> Iterator[LocalServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install-tools.sh redis-server)")
    with redis_server() as s:
        yield s


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalServer]:
    pytest.importorskip("moto", reason="moto is not installed (the test extra installs it)")
    with s3_server() as s:
        yield s
