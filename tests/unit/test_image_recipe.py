"""The image's two recipes agree with each other and with the chart.

``image/build.py`` (``make image``, no registry) takes user, entrypoint, environment and labels
from the Dockerfile's last stage; these tests parse the Dockerfile the same way and hold it to
the chart's security context and default image, and check the pure part of the package
selection. Neither podman nor root is needed here.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import yaml

REPO = Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"image_{name}", REPO / "image" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build = load("build")
VALUES = yaml.safe_load((REPO / "helm/gpualloc/values.yaml").read_text())
CHART = yaml.safe_load((REPO / "helm/gpualloc/Chart.yaml").read_text())
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_dockerfile_user_is_the_charts_run_as_user_and_group() -> None:
    context = VALUES["securityContext"]
    assert build.dockerfile_config()["user"] == f"{context['runAsUser']}:{context['runAsGroup']}"
    assert VALUES["podSecurityContext"]["runAsUser"] == context["runAsUser"] == build.NONROOT


def test_dockerfile_entrypoint_is_gpualloc_and_the_chart_passes_the_subcommand_as_args() -> None:
    config = build.dockerfile_config()
    assert config["entrypoint"] == ["gpualloc"]
    for template in ("agent-daemonset.yaml", "controller-deployment.yaml", "webhook-deployment.yaml"):
        text = (REPO / "helm/gpualloc/templates" / template).read_text()
        assert "args:" in text and "command:" not in text, template


def test_dockerfile_workdir_is_the_charts_writable_tmp_and_the_venv_is_on_path() -> None:
    config = build.dockerfile_config()
    assert config["workdir"] == "/tmp"  # the chart's emptyDir; the rest is read-only
    assert config["env"]["PATH"].startswith(f"{build.VENV}/bin:")  # type: ignore[index]


def test_image_version_label_and_the_charts_default_image_follow_the_package_version() -> None:
    labels = build.dockerfile_config()["labels"]
    assert labels["org.opencontainers.image.version"] == VERSION  # type: ignore[index]
    assert CHART["appVersion"] == VERSION
    assert VALUES["image"]["repository"] == build.REPOSITORY
    assert VALUES["image"]["tag"] in ("", VERSION)


def test_the_check_runs_containers_as_the_charts_user_read_only_without_capabilities() -> None:
    check = load("check")
    assert build.dockerfile_config()["user"] == check.USER
    assert {"--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges"} <= set(check.CHART_SECURITY)
    assert VALUES["securityContext"]["readOnlyRootFilesystem"] is True
    assert VALUES["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert VALUES["securityContext"]["allowPrivilegeEscalation"] is False


def test_dockerfile_parser_joins_continued_lines_and_reads_only_the_last_stage(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        'FROM a AS build\nUSER 1\nENTRYPOINT ["x"]\n'
        'FROM b\n# a comment\nENV A=1 \\\n    B="two words"\n'
        'LABEL k="v 1" \\\n  # inside\n  k2=v2\nUSER 65532:65532\nWORKDIR /tmp\n'
        'ENTRYPOINT ["gpualloc"]\nCMD ["--help"]\n'
    )
    assert build.dockerfile_config(dockerfile) == {
        "env": {"A": "1", "B": "two words"},
        "labels": {"k": "v 1", "k2": "v2"},
        "user": "65532:65532",
        "workdir": "/tmp",
        "entrypoint": ["gpualloc"],
        "cmd": ["--help"],
    }


def fields(depends: str = "", pre: str = "", provides: str = "") -> dict[str, str]:
    return {
        "Pre-Depends": pre,
        "Depends": depends,
        "Provides": provides,
        "Version": "1",
        "Installed-Size": "1",
    }


def test_package_closure_follows_depends_and_provides_but_ships_no_dpkg_or_shell() -> None:
    installed = {
        "python3.11": fields(
            "python3.11-minimal (= 3.11.2), libpython3.11-stdlib, media-types | mime-support"
        ),
        "python3.11-minimal": fields("libssl3", pre="dpkg (>= 1.17)"),
        "libpython3.11-stdlib": fields("libreadline8, libmime"),
        "libssl3": fields("libc6"),
        "libc6": fields("libgcc-s1"),
        "libgcc-s1": fields(),
        "libstdc++6": fields("libc6, libgcc-s1"),
        "libreadline8": fields("readline-common"),
        "readline-common": fields("dpkg"),
        "mime-support": fields(provides="libmime, media-types"),
        "dpkg": fields("tar, libc6", pre="libc6"),
        "tar": fields(),
        "netbase": fields(),
        "base-files": fields(pre="mawk | awk"),
        "mawk": fields(provides="awk"),
        "bash": fields(),
    }
    assert build.package_closure(installed) == [
        "base-files",
        "libc6",
        "libgcc-s1",
        "libpython3.11-stdlib",
        "libreadline8",
        "libssl3",
        "libstdc++6",
        "mime-support",
        "netbase",
        "python3.11",
        "python3.11-minimal",
        "readline-common",
    ]
