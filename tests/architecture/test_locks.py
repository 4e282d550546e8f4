"""The lock files pin what pyproject.toml asks for: every requirement of the main venv
(with the test, gpu, transformers and tracing extras), of the vLLM venv (with the test extra
and requirements/vllm.in) and of the SGLang venv (kvtier's own but its torch pin, the test
extra, requirements/sglang.in and SGLang itself) is pinned to one version that satisfies
it, and the venv the main suite runs in has exactly the locked versions of what it asks
for. A change to pyproject.toml without `make lock` fails here, not on a fresh clone."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;]+)")


def pins(lock: Path) -> dict[str, Version]:
    found = {}
    for line in lock.read_text().splitlines():
        match = PIN.match(line)
        if match:
            found[canonicalize_name(match[1])] = Version(match[2])
    return found


def requirements(extras: tuple[str, ...], *more: Path, own_torch: bool = True
                 ) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line for line in project["dependencies"]
             if own_torch or Requirement(line).name != "torch"]
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    for path in more:
        lines += [line for line in path.read_text().splitlines()
                  if line.strip() and not line.startswith("#")]
    return [Requirement(line) for line in lines]


LOCKS = {
    "lock.txt": (("test", "gpu", "transformers", "tracing"), ()),
    "vllm.lock": (("test",), (ROOT / "requirements" / "vllm.in",)),
}
# SGLang's host pool needs torch 2.14.1 (requirements/sglang.in), not kvtier's 2.13.0
SGLANG_LOCK = ("sglang.lock", ("test",), (ROOT / "requirements" / "sglang.in",
                                          ROOT / "requirements" / "sglang-nodeps.in"))


@pytest.mark.parametrize("lock", [*sorted(LOCKS), SGLANG_LOCK[0]])
def test_every_requirement_is_pinned_to_a_version_that_satisfies_it(lock: str) -> None:
    own_torch = lock in LOCKS
    extras, more = LOCKS[lock] if own_torch else SGLANG_LOCK[1:]
    pinned = pins(ROOT / "requirements" / lock)
    unpinned = []
    for requirement in requirements(extras, *more, own_torch=own_torch):
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unpinned.append(f"{requirement} (locked: {version})")
    assert not unpinned, f"requirements/{lock} is stale, run `make lock`: {unpinned}"


def test_the_lock_pins_the_cpu_torch_by_its_public_version() -> None:
    # pip takes the local CPU wheel for ==2.13.0; a `+cpu` pin fails where there is none
    for lock in LOCKS:
        assert pins(ROOT / "requirements" / lock)["torch"] == Version("2.13.0")
        assert "+cpu" not in (ROOT / "requirements" / lock).read_text()


def test_the_sglang_lock_pins_the_torch_its_host_pool_imports_with() -> None:
    # torchvision 0.28 fails against the CPU torch 2.13.0, and SGLang's host pool with it
    pinned = pins(ROOT / "requirements" / SGLANG_LOCK[0])
    assert (pinned["torch"], pinned["torchvision"]) == (Version("2.14.1"), Version("0.29.1"))
    assert pinned["sglang"] == Version("0.5.23")


def test_this_venv_has_the_locked_versions() -> None:
    pinned = pins(ROOT / "requirements" / "lock.txt")
    extras, more = LOCKS["lock.txt"]
    differ = []
    for requirement in requirements(extras, *more):
        name = canonicalize_name(requirement.name)
        installed = Version(Version(metadata.version(name)).public)
        if installed != pinned[name]:
            differ.append(f"{name} {installed} (locked {pinned[name]})")
    assert not differ, f"this venv is not requirements/lock.txt's, run `make install`: {differ}"
