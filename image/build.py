"""Build the gpualloc image from Debian packages, without a container registry.

    python image/build.py [--out DIR]      (``make image``; needs root, mmdebstrap, umoci, skopeo)

No base image is pulled. The steps:

1. the wheel, from ``git archive HEAD`` (what is committed, as a fresh clone has it), and its
   runtime dependencies, downloaded from PyPI as wheels;
2. ``mmdebstrap`` a Debian bookworm root with ``python3.11``;
3. copy into the image only the files of ``python3.11`` and the packages it depends on (plus
   ``netbase`` and ``base-files``), the way distroless images are made: no dpkg, apt, shell,
   coreutils or perl; no docs, man pages or locales. ``/var/lib/dpkg/status`` keeps the stanzas
   of the packages whose files are there, so that scanners see what the image holds;
4. layer 1: that Python runtime; layer 2: a virtual environment in ``/opt/gpualloc`` with the
   wheel and its dependencies, installed inside the root by pip run from its wheel (pip itself
   is not installed);
5. user, entrypoint, command, environment, working directory and labels come from the
   Dockerfile's last stage at HEAD (``dockerfile_config``), so the Dockerfile, the recipe for those
   with a registry, and this build cannot drift apart; tests/unit/test_image_recipe.py checks
   both against the chart's security context;
6. an OCI archive (``oci-archive``) named ``ghcr.io/gpualloc/gpualloc:<version>``, the chart's
   default image, written outside the repository; the last line printed gives its path, size
   and build time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPOSITORY = "ghcr.io/gpualloc/gpualloc"
SUITE = "bookworm"
MIRRORS = (
    f"deb http://deb.debian.org/debian {SUITE} main",
    f"deb http://deb.debian.org/debian {SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {SUITE}-security main",
)
PYTHON = "python3.11"
# The roots of the package closure whose files the image holds. libstdc++6: grpcio's C extension
# (the agent's kubelet plugin) links it, and nothing python3.11 depends on brings it.
ROOTS = (PYTHON, "netbase", "base-files", "libstdc++6")
# Dependencies that are only needed to install packages, never to run Python (base-passwd: the
# image's /etc/passwd and /etc/group are written below).
NOT_SHIPPED = frozenset(
    {"dpkg", "tar", "debconf", "perl-base", "mawk", "bash", "dash", "coreutils", "debianutils", "base-passwd"}
)
# Paths never copied (prefixes).
STRIPPED = (
    "/usr/share/doc/",
    "/usr/share/man/",
    "/usr/share/info/",
    "/usr/share/locale/",
    "/usr/share/lintian/",
    "/usr/share/bug/",
    "/usr/share/doc-base/",
    "/usr/share/bash-completion/",
    "/usr/share/menu/",
    "/usr/share/pixmaps/",
    "/usr/share/applications/",
    "/usr/bin/pydoc",
    "/usr/lib/python3.11/pydoc_data/",
)
VENV = "/opt/gpualloc"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NONROOT = 65532


def log(message: str) -> None:
    print(f"[image {time.strftime('%H:%M:%S')}] {message}", flush=True)


# What the commands run inside the root see: nothing of the host's environment (PIP_* included).
CHROOT_ENV = {"PATH": DEFAULT_PATH, "HOME": "/root", "LC_ALL": "C.UTF-8"}


def run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    args = [str(a) for a in argv]
    if args[0] == "chroot":
        kwargs.setdefault("env", CHROOT_ENV)
    try:
        return subprocess.run(args, check=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]
    except subprocess.CalledProcessError as exc:
        sys.exit(f"failed ({exc.returncode}): {shlex.join(args)}\n{exc.stderr or ''}")


# -- the Dockerfile as the source of the image configuration -----------------------------------


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def _pairs(arguments: str) -> dict[str, str]:
    """``k=v k2="v 2"`` (LABEL, ENV) as a dict."""
    result = {}
    for word in shlex.split(arguments):
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"only the key=value form is understood: {arguments!r}")
        result[key] = value
    return result


def dockerfile_config(path: Path = REPO / "Dockerfile") -> dict[str, object]:
    """User, entrypoint, command, environment, working directory and labels of the last stage."""
    stages: list[list[str]] = []
    for line in _logical_lines(path.read_text()):
        if line.upper().startswith("FROM "):
            stages.append([])
        elif stages:
            stages[-1].append(line)
    config: dict[str, object] = {"env": {}, "labels": {}}
    for line in stages[-1]:
        instruction, _, arguments = line.partition(" ")
        instruction, arguments = instruction.upper(), arguments.strip()
        if instruction == "USER":
            config["user"] = arguments
        elif instruction == "WORKDIR":
            config["workdir"] = arguments
        elif instruction in ("ENTRYPOINT", "CMD"):
            config[instruction.lower()] = json.loads(arguments)  # the exec form only
        elif instruction == "ENV":
            config["env"].update(_pairs(arguments))  # type: ignore[attr-defined]
        elif instruction == "LABEL":
            config["labels"].update(_pairs(arguments))  # type: ignore[attr-defined]
    return config


def version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


# -- 1. the wheel and its dependencies ---------------------------------------------------------


def build_wheels(work: Path, venv_python: Path) -> tuple[Path, Path]:
    """The wheel of what HEAD holds, and its dependencies; returns (wheel, source tree)."""
    source, wheels = work / "src", work / "wheels"
    source.mkdir()
    wheels.mkdir()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(source)], input=tar.stdout, check=True)
    log("wheel: pip wheel")
    run(
        venv_python,
        *["-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels), str(source)],
        capture_output=True,
    )
    (wheel,) = wheels.glob("gpualloc-*.whl")
    check_wheel(wheel)
    log(f"wheel: {wheel.name}; dependencies from PyPI as wheels")
    run(
        venv_python,
        *["-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(wheels), str(wheel), "pip"],
        capture_output=True,
    )
    return wheel, source


def check_wheel(wheel: Path) -> None:
    """The Dockerfile's check: every component package is in the wheel."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    wanted = ("gpualloc/cli.py", "agent/", "controller/", "webhook/", "certs/")
    missing = [p for p in wanted if not any(n.startswith(p) for n in names)]
    if missing:
        sys.exit(f"missing from {wheel.name}: {missing}")


# -- 2. and 3. the Python runtime from Debian packages -----------------------------------------


def debian_root(work: Path) -> Path:
    full = work / "debian"
    log(f"mmdebstrap {SUITE} with {PYTHON} (the full root, files are picked from it)")
    run(
        "mmdebstrap",
        "--variant=essential",
        f"--include={PYTHON},netbase,libstdc++6",
        "--mode=root",
        "--quiet",
        "--aptopt=Acquire::Retries 3",
        SUITE,
        full,
        *MIRRORS,
    )
    return full


def _installed(full: Path) -> dict[str, dict[str, str]]:
    fields = ("Package", "Version", "Pre-Depends", "Depends", "Provides", "Installed-Size")
    out = run(
        "chroot",
        full,
        "dpkg-query",
        "-W",
        "-f=" + "\t".join(f"${{{f}}}" for f in fields) + "\n",
        capture_output=True,
    ).stdout
    return {
        line.split("\t")[0]: dict(zip(fields, line.split("\t"), strict=True)) for line in out.splitlines()
    }


def package_closure(installed: dict[str, dict[str, str]]) -> list[str]:
    """ROOTS and what they depend on (Pre-Depends, Depends), less NOT_SHIPPED."""
    providers: dict[str, str] = {}
    for name, fields in installed.items():
        for provided in fields["Provides"].split(","):
            providers.setdefault(provided.strip().split(" ")[0], name)
    seen: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in seen or name in NOT_SHIPPED:
            continue
        seen.add(name)
        fields = installed[name]
        for group in f"{fields['Pre-Depends']},{fields['Depends']}".split(","):
            for alternative in group.split("|"):
                wanted = alternative.strip().split(" ")[0].split(":")[0]
                if wanted in installed or wanted in providers:
                    todo.append(wanted if wanted in installed else providers[wanted])
                    break
    return sorted(seen)


def _canonical(full: Path, path: str) -> str:
    """The path with its directories resolved inside the root (/lib64/x -> /usr/lib64/x)."""
    parent, name = os.path.split(path)
    resolved = os.path.realpath(str(full) + parent)  # the root has usr-merged symlinks only
    return os.path.join(resolved.removeprefix(str(full)) or "/", name)


def runtime_root(full: Path, rootfs: Path) -> list[str]:
    installed = _installed(full)
    packages = package_closure(installed)
    paths: set[str] = set()
    for name in packages:
        listed = run("chroot", full, "dpkg-query", "-L", name, capture_output=True).stdout.split("\n")
        for path in filter(None, listed):
            if path in ("/.", "/") or path.startswith(STRIPPED) or path.rstrip("/") + "/" in STRIPPED:
                continue
            paths.add(_canonical(full, path))
    # ld.so's configuration (libc-bin, not shipped) so that the cache below can be made, as the
    # NVIDIA container toolkit does again after mounting libnvidia-ml.so.1.
    paths.update(["/etc/ld.so.conf", "/etc/ld.so.conf.d"])
    paths.update("/etc/ld.so.conf.d/" + p.name for p in (full / "etc/ld.so.conf.d").iterdir())
    listing = rootfs.parent / "files.txt"
    listing.write_text("".join(p.lstrip("/") + "\n" for p in sorted(paths)))
    for link in ("bin", "sbin", "lib", "lib64"):  # the usr-merge symlinks
        if (full / link).is_symlink():
            os.symlink(os.readlink(full / link), rootfs / link)
    tar = subprocess.Popen(
        ["tar", "-C", str(full), "-c", "--no-recursion", "-T", str(listing), "-f", "-"],
        stdout=subprocess.PIPE,
    )
    subprocess.run(
        ["tar", "-C", str(rootfs), "-x", "--keep-directory-symlink", "-f", "-"], stdin=tar.stdout, check=True
    )
    if tar.wait() != 0:
        sys.exit("tar of the runtime files failed")
    # dpkg status: only the stanzas of the packages whose files are here.
    status = (full / "var/lib/dpkg/status").read_text().split("\n\n")
    kept = [s for s in status if (m := re.match(r"Package: (\S+)", s)) and m.group(1) in packages]
    (rootfs / "var/lib/dpkg").mkdir(parents=True, exist_ok=True)
    (rootfs / "var/lib/dpkg/status").write_text("\n\n".join(kept).strip() + "\n")
    # Users: root and the non-root user of the chart; /tmp and a home for it.
    (rootfs / "etc/passwd").write_text(
        f"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{NONROOT}:{NONROOT}:nonroot:/home/nonroot:/sbin/nologin\n"
    )
    (rootfs / "etc/group").write_text(f"root:x:0:\nnonroot:x:{NONROOT}:\n")
    for directory, mode, owner in (("tmp", 0o1777, 0), ("root", 0o700, 0), ("home/nonroot", 0o700, NONROOT)):
        (rootfs / directory).mkdir(parents=True, exist_ok=True)
        os.chmod(rootfs / directory, mode)
        os.chown(rootfs / directory, owner, owner)
    run("ldconfig", "-r", rootfs)
    log(f"runtime: {len(packages)} Debian packages, {len(paths)} paths; the standard library byte-compiled")
    run("chroot", rootfs, f"/usr/bin/{PYTHON}", "-m", "compileall", "-q", "-j", "1", f"/usr/lib/{PYTHON}")
    return [f"{n}={installed[n]['Version']}" for n in packages]


# -- 4. the virtual environment ----------------------------------------------------------------


def install_venv(rootfs: Path, wheels: Path, wheel: Path) -> list[str]:
    inside = rootfs / "wheels"
    shutil.copytree(wheels, inside)
    (pip,) = inside.glob("pip-*.whl")
    try:
        run("chroot", rootfs, f"/usr/bin/{PYTHON}", "-m", "venv", "--without-pip", VENV)
        run(
            "chroot",
            rootfs,
            f"{VENV}/bin/python",
            f"/wheels/{pip.name}/pip",
            "install",
            "-q",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--find-links=/wheels",
            f"/wheels/{wheel.name}",
        )
        frozen = run(
            "chroot",
            rootfs,
            f"{VENV}/bin/python",
            f"/wheels/{pip.name}/pip",
            "freeze",
            "--disable-pip-version-check",
            capture_output=True,
        ).stdout.splitlines()
        for component in ("agent", "controller", "webhook", "certs"):  # each imports its package
            run("chroot", rootfs, f"{VENV}/bin/gpualloc", component, "--help", capture_output=True)
    finally:
        shutil.rmtree(inside)
    return frozen


# -- 5. and 6. the OCI image --------------------------------------------------------------------


def oci_image(
    work: Path, full: Path, wheels: Path, wheel: Path, dockerfile: Path, archive: Path, tag: str
) -> dict[str, object]:
    layout, bundle = work / "oci", work / "bundle"
    run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", f"{layout}:{tag}")
    run("umoci", "unpack", "--image", f"{layout}:{tag}", bundle, capture_output=True)
    rootfs = bundle / "rootfs"
    packages = runtime_root(full, rootfs)
    run(
        "umoci",
        "repack",
        "--image",
        f"{layout}:{tag}",
        "--history.created_by=debian packages: " + " ".join(ROOTS),
        bundle,
    )
    log(f"layer 2: {VENV}, the wheel and its dependencies")
    frozen = install_venv(rootfs, wheels, wheel)
    # A second repack would diff against the bundle's original (empty) image, not layer 1.
    venv = work / "venv"
    shutil.move(rootfs / VENV.lstrip("/"), venv)
    run(
        "umoci",
        "insert",
        "--image",
        f"{layout}:{tag}",
        f"--history.created_by=pip install {wheel.name}",
        venv,
        VENV,
    )

    config = dockerfile_config(dockerfile)
    commit = run("git", "-C", REPO, "rev-parse", "HEAD", capture_output=True).stdout.strip()
    labels = {
        **config["labels"],  # type: ignore[dict-item]
        "org.opencontainers.image.revision": commit,
        "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "org.opencontainers.image.base.name": f"debian:{SUITE} ({PYTHON} from Debian packages)",
    }
    env = {k: v.replace("$PATH", DEFAULT_PATH) for k, v in config["env"].items()}  # type: ignore[attr-defined]
    env.setdefault("PATH", DEFAULT_PATH)
    args = [
        "umoci",
        "config",
        "--image",
        f"{layout}:{tag}",
        "--config.user",
        str(config["user"]),
        "--config.workingdir",
        str(config["workdir"]),
        "--clear=config.entrypoint",
        "--clear=config.cmd",
        "--clear=config.env",
        "--history.created_by=config from the Dockerfile",
    ]
    args += [f"--config.entrypoint={a}" for a in config["entrypoint"]]  # type: ignore[attr-defined]
    args += [f"--config.cmd={a}" for a in config.get("cmd", [])]  # type: ignore[attr-defined]
    args += [f"--config.env={k}={v}" for k, v in env.items()]
    args += [f"--config.label={k}={v}" for k, v in labels.items()]
    run(*args)
    run("umoci", "gc", "--layout", layout)
    archive.unlink(missing_ok=True)
    run("skopeo", "copy", "--quiet", f"oci:{layout}:{tag}", f"oci-archive:{archive}:{REPOSITORY}:{tag}")
    return {"packages": packages, "python_packages": frozen, "labels": labels, "env": env}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache/gpualloc/image")
    parser.add_argument(
        "--python",
        type=Path,
        default=REPO / ".venv/bin/python",
        help="the Python that builds the wheel (mypy and setuptools installed: make setup)",
    )
    parser.add_argument("--keep-work", action="store_true", help="keep the build directory (the roots)")
    args = parser.parse_args(argv)
    missing = [t for t in ("mmdebstrap", "umoci", "skopeo", "chroot", "ldconfig") if not shutil.which(t)]
    if missing:
        sys.exit(f"missing: {', '.join(missing)} (Debian: apt-get install mmdebstrap umoci skopeo)")
    if os.geteuid() != 0:
        sys.exit("the build needs root (mmdebstrap --mode=root, chroot, files owned by 65532)")
    started = time.monotonic()
    tag = version()
    args.out.mkdir(parents=True, exist_ok=True)
    archive = args.out / f"gpualloc-{tag}.oci.tar"
    work = Path(tempfile.mkdtemp(prefix="build-", dir=args.out))
    try:
        wheel, source = build_wheels(work, args.python)
        full = debian_root(work)
        manifest = oci_image(work, full, work / "wheels", wheel, source / "Dockerfile", archive, tag)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - started
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    manifest.update(
        image=f"{REPOSITORY}:{tag}",
        archive=str(archive),
        archive_bytes=archive.stat().st_size,
        archive_sha256=digest,
        build_seconds=round(seconds, 1),
    )
    (args.out / f"gpualloc-{tag}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = archive.stat().st_size / 2**20
    print(f"{archive}  {size:.1f} MiB  {REPOSITORY}:{tag}  built in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
