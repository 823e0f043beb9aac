"""An NVML substitute with pynvml's function names, injected instead of pynvml.

Errors are the real pynvml exception classes, so the code under test handles
exactly what it would get from NVML (e.g. NVMLError_NotSupported for MIG queries on
GPUs without MIG).
"""

from __future__ import annotations

from types import SimpleNamespace

import pynvml


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded

    def __init__(self, gpus: list[dict], driver: str = "580.65.06", cuda: int = 13000,
                 init_error: int | None = None) -> None:
        self.gpus = gpus
        self.driver, self.cuda, self.init_error = driver, cuda, init_error
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise _err(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int):
        if i >= len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("gpu", i)

    def _gpu(self, h):
        return self.gpus[h[1]]

    def nvmlDeviceGetName(self, h) -> str:
        return self._gpu(h)["name"]

    def nvmlDeviceGetUUID(self, h) -> str:
        if h[0] == "mig":
            return self._gpu(h)["mig"][h[2]]
        return self._gpu(h)["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        total = self._gpu(h).get("memory", 80 * 1024 ** 3)
        if h[0] == "mig":
            total //= 7
        return SimpleNamespace(total=total, used=0, free=total)

    def nvmlDeviceGetBrand(self, h) -> int:
        return self._gpu(h).get("brand", pynvml.NVML_BRAND_NVIDIA)  # what an H200 answers

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._gpu(h).get("cc", (9, 0))

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{h[1] + 0x10:02X}:00.0".encode())

    def nvmlDeviceGetMigMode(self, h):
        if "mig" not in self._gpu(h):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, h) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j: int):
        if j >= len(self._gpu(h)["mig"]):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return ("mig", h[1], j)

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda


def h100s(n: int = 4, **extra) -> list[dict]:
    return [{"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08x}-1111-2222-3333-444455556666",
             "memory": 80 * 1024 ** 3, "cc": (9, 0), **extra} for i in range(n)]
