"""The monorepo's distributions, their one version, and the checks a release needs.

The version is written once, in ``core/src/cardcage/_version.py``: cardcage-core reads it
(hatch's version source), every other distribution repeats it in its pyproject.toml, and a
requirement of one distribution on another is the range that version implies
(``cardcage-core>=0.1,<0.2`` for 0.1.x; ``cardcage new-plugin`` writes the same range).

    python scripts/release.py list                # the distributions' folders, one a line
    python scripts/release.py check               # the source tree (below); exit 1 on a problem
    python scripts/release.py check-dist dist/    # the built sdists and wheels
    python scripts/release.py bump 0.2.0          # write a new version everywhere

``check``: every distribution's version is the core's; every requirement on another
distribution of the monorepo names one that exists, with extras it has and the range of the
version (examples/plugin-tutorial's too, a third-party plugin's example); the
meta-distribution ``cardcage`` reaches every other one (a dependency or an extra); every
distribution has its README as ``readme`` and the root's LICENSE, unchanged; CHANGELOG.md has
a section for the version; the install hints of horovod and tpu name commands that work from
a pip install (the builder that ships in cardcage-horovod, the torch and torch-xla pair of
cardcage-tpu's ``engine`` extra).

``check-dist``: one sdist and one wheel per distribution and nothing else, named for the
version; each wheel's metadata has the version, the README as a Markdown long description,
the licence (expression and file), the same dependencies and entry points as its
pyproject.toml; each wheel holds exactly the files of its package sources (templates and
``py.typed`` included); each sdist holds its PKG-INFO, pyproject.toml, README, LICENSE and
sources, and nothing of another distribution or of ``__pycache__``.

``nox -s build`` runs ``check``, builds into dist/, runs ``twine check --strict`` and then
``check-dist``. Standard library and ``packaging`` only.
"""

from __future__ import annotations

import argparse
import configparser
import email.parser
import email.policy
import re
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = ROOT / "core" / "src" / "cardcage" / "_version.py"
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)
PYPROJECT_VERSION = re.compile(r'^version = "([^"]+)"$', re.MULTILINE)
# A requirement on a distribution of the monorepo, as pyproject.toml writes it.
RANGE_IN_TOML = re.compile(r'("cardcage(?:-[a-z0-9]+)?(?:\[[^\]]*\])?)>=[0-9.]+,<[0-9.]+(")')
META = "cardcage"
# Projects that are no distribution of ours but require one (a third-party plugin's example):
# their range is checked, and bumped, with the others'.
DEPENDENTS = ("examples/plugin-tutorial/pyproject.toml",)
# What the wheels must hold, by distribution, beyond "every file of the package sources" (a
# named file says plainly what went missing).
MUST_HOLD = {
    "cardcage-core": ("cardcage/py.typed", "cardcage/templates/plugin/pyproject.toml.tmpl"),
    "cardcage-submit": ("cardcage_submit/py.typed",),
    "cardcage-horovod": ("cardcage_horovod/__init__.py", "cardcage_horovod/build.py"),
}
HOROVOD_HINT = "python -m cardcage_horovod.build --install"


@dataclass
class Project:
    folder: Path
    pyproject: dict[str, Any]

    @property
    def name(self) -> str:
        return str(canonicalize_name(self.pyproject["project"]["name"]))

    @property
    def relative(self) -> str:
        return self.folder.relative_to(ROOT).as_posix() or "."

    @property
    def file_stem(self) -> str:
        """The name as sdist and wheel file names spell it: ``cardcage_core``."""
        return self.name.replace("-", "_")

    def requirements(self) -> list[tuple[str, Requirement]]:
        """``(where, requirement)`` for its dependencies and every extra's."""
        project = self.pyproject["project"]
        found = [("dependencies", Requirement(r)) for r in project.get("dependencies", [])]
        for extra, specs in project.get("optional-dependencies", {}).items():
            found += [(f"extra {extra!r}", Requirement(r)) for r in specs]
        return found

    def extras(self) -> set[str]:
        return set(self.pyproject["project"].get("optional-dependencies", {}))

    def entry_points(self) -> dict[str, dict[str, str]]:
        """Its entry points by group, console scripts as ``console_scripts``."""
        project = self.pyproject["project"]
        groups = {group: dict(eps) for group, eps in project.get("entry-points", {}).items()}
        if project.get("scripts"):
            groups["console_scripts"] = dict(project["scripts"])
        return groups

    def package_files(self) -> dict[str, str]:
        """The files its wheel must hold: path in the wheel -> path in the project folder."""
        wheel = self.pyproject.get("tool", {}).get("hatch", {}).get("build", {})
        wheel = wheel.get("targets", {}).get("wheel", {})
        if wheel.get("bypass-selection"):
            return {}
        files: dict[str, str] = {}
        for entry in wheel.get("packages", []):  # "src/cardcage": the folder, as "cardcage"
            base = PurePosixPath(entry)
            for path in _tree(self.folder / entry):
                files[f"{base.name}/{path}"] = f"{base}/{path}"
        for entry in wheel.get("only-include", []):  # a module or a package, kept as it is
            if (self.folder / entry).is_dir():
                files.update({f"{entry}/{p}": f"{entry}/{p}" for p in _tree(self.folder / entry)})
            else:
                files[entry] = entry
        return files

    def requires_dist(self) -> set[str]:
        """Its requirements as the wheel's Requires-Dist lines should say them (an extra that
        names its own distribution's extras, as `cardcage[all]` does, spelled out)."""
        project = self.pyproject["project"]
        found = {str(Requirement(spec)) for spec in project.get("dependencies", [])}
        extras = project.get("optional-dependencies", {})
        for extra in extras:
            specs, seen = list(extras[extra]), {extra}
            while specs:
                requirement = Requirement(specs.pop())
                if canonicalize_name(requirement.name) == self.name:
                    for own in sorted(set(requirement.extras) - seen):
                        specs += extras[own]
                        seen.add(own)
                    continue
                marker = f'extra == "{extra}"'
                if requirement.marker is not None:
                    marker = f"({requirement.marker}) and {marker}"
                requirement.marker = None
                found.add(str(Requirement(f"{requirement}; {marker}")))
        return found


def _tree(folder: Path) -> set[str]:
    """The files under ``folder`` (posix, relative), less bytecode."""
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def projects() -> list[Project]:
    """The distributions of the monorepo: the root, core/, plugins/*/, extensions/*/."""
    folders = [ROOT, ROOT / "core"]
    folders += sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))
    folders += sorted(p.parent for p in ROOT.glob("extensions/*/pyproject.toml"))
    return [Project(f, tomllib.loads((f / "pyproject.toml").read_text())) for f in folders]


def version() -> str:
    match = VERSION_LINE.search(VERSION_FILE.read_text())
    if match is None:
        raise SystemExit(f"{VERSION_FILE.relative_to(ROOT)} has no __version__ line")
    return match.group(1)


def version_range(release: str) -> str:
    """``>=0.1,<0.2`` for 0.1.x: the range every distribution asks of another."""
    parsed = Version(release)
    major, minor = parsed.major, parsed.minor
    return f">={major}.{minor},<{major}.{minor + 1}"


def project_version(project: Project) -> str | None:
    """Its version as pyproject.toml gives it, or as hatch reads it for a dynamic one."""
    table = project.pyproject["project"]
    if "version" in table:
        return str(table["version"])
    source = project.pyproject.get("tool", {}).get("hatch", {}).get("version", {})
    if "version" in table.get("dynamic", []) and "path" in source:
        match = VERSION_LINE.search((project.folder / source["path"]).read_text())
        return match.group(1) if match else None
    return None


# -- the source tree --------------------------------------------------------------------------


def check_tree() -> list[str]:
    problems: list[str] = []
    release = version()
    found = projects()
    by_name = {p.name: p for p in found}
    licence = (ROOT / "LICENSE").read_text()
    for project in found:
        where = f"{project.relative}/pyproject.toml"
        if project_version(project) != release:
            problems.append(
                f"{where}: {project.name} is version {project_version(project)}, but "
                f"core/src/cardcage/_version.py says {release} (python scripts/release.py bump "
                f"{release} writes it everywhere)"
            )
        problems += _check_requirements(project, by_name, release)
        if project.pyproject["project"].get("readme") != "README.md":
            problems.append(f"{where}: readme is not README.md")
        if not (project.folder / "README.md").is_file():
            problems.append(f"{project.relative}: no README.md")
        if project.pyproject["project"].get("license") != "MIT":
            problems.append(f"{where}: license is not the SPDX expression 'MIT'")
        own = project.folder / "LICENSE"
        if not own.is_file() or own.read_text() != licence:
            problems.append(f"{project.relative}/LICENSE: missing or not a copy of ./LICENSE")
    for relative in DEPENDENTS:
        path = ROOT / relative
        dependent = Project(path.parent, tomllib.loads(path.read_text()))
        problems += _check_requirements(dependent, by_name, release)
    reached = {canonicalize_name(r.name) for _, r in by_name[META].requirements()}
    for name in sorted(set(by_name) - reached - {META}):
        problems.append(f"pyproject.toml: the meta-distribution reaches no {name} (add an extra)")
    changelog = ROOT / "CHANGELOG.md"
    if not re.search(rf"^## \[?{re.escape(release)}\]?", changelog.read_text(), re.MULTILINE):
        problems.append(f"CHANGELOG.md: no section '## {release}'")
    problems += _check_hints()
    return problems


def _check_requirements(project: Project, by_name: dict[str, Project], release: str) -> list[str]:
    """Its requirements on distributions of the monorepo: known ones, with extras they have,
    and the range of ``release``."""
    problems = []
    where = f"{project.relative}/pyproject.toml"
    wanted = Requirement(f"x{version_range(release)}").specifier
    for context, requirement in project.requirements():
        other = str(canonicalize_name(requirement.name))
        if other == project.name or not other.startswith(META):
            continue  # a third-party requirement, or the meta-distribution's `all` extra
        if other not in by_name:
            problems.append(f"{where}: {context} requires {other}, not a distribution here")
            continue
        missing = set(requirement.extras) - by_name[other].extras()
        if missing:
            problems.append(f"{where}: {context} asks {other} for extra(s) {sorted(missing)}")
        if requirement.specifier != wanted:
            problems.append(
                f"{where}: {context} requires {requirement}; for version {release} the range "
                f"is {other}{version_range(release)}"
            )
    return problems


def _check_hints() -> list[str]:
    """The commands the horovod and tpu plugins tell a pip user to run."""
    problems = []
    horovod = ROOT / "plugins" / "horovod"
    if HOROVOD_HINT not in (horovod / "cardcage_horovod" / "__init__.py").read_text():
        problems.append(f"plugins/horovod: the install hint does not name `{HOROVOD_HINT}`")
    if not (horovod / "cardcage_horovod" / "build.py").is_file():
        problems.append("plugins/horovod: cardcage_horovod/build.py (the builder) is missing")
    tpu = ROOT / "plugins" / "tpu"
    engine = tomllib.loads((tpu / "pyproject.toml").read_text())["project"]
    pair = engine.get("optional-dependencies", {}).get("engine", [])
    command = "pip install " + " ".join(pair)
    if len(pair) != 2 or not all("==" in p for p in pair):
        problems.append("plugins/tpu: the engine extra must pin torch and torch-xla (==)")
    elif command not in (tpu / "cardcage_tpu.py").read_text():
        problems.append(f"plugins/tpu: the install hint does not name `{command}`")
    return problems


# -- the built distributions ------------------------------------------------------------------


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _metadata(text: str) -> Any:
    return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


def check_dist(dist: Path) -> Report:
    report = Report()
    if not dist.is_dir():
        report.problems.append(f"{dist}: no such folder (`nox -s build` makes dist/)")
        return report
    release = version()
    licence = (ROOT / "LICENSE").read_text()
    found = projects()
    expected: set[str] = set()
    for project in found:
        sdist = dist / f"{project.file_stem}-{release}.tar.gz"
        wheel = dist / f"{project.file_stem}-{release}-py3-none-any.whl"
        expected |= {sdist.name, wheel.name}
        for path in (sdist, wheel):
            if not path.is_file():
                report.problems.append(f"{path.name}: missing (for {project.relative})")
        if wheel.is_file():
            report.problems += _check_wheel(project, wheel, release, licence)
        if sdist.is_file():
            report.problems += _check_sdist(project, sdist, found)
    present = {p.name for p in dist.iterdir()}
    for extra in sorted(present - expected):
        report.problems.append(f"{extra}: not a distribution of this version (a stale build?)")
    wheels = sorted(p for p in present if p.endswith(".whl"))
    sdists = sorted(p for p in present if p.endswith(".tar.gz"))
    report.lines.append(
        f"{len(wheels)} wheels and {len(sdists)} sdists of {len(found)} distributions, "
        f"version {release}"
    )
    return report


def _check_wheel(project: Project, wheel: Path, release: str, licence: str) -> list[str]:
    problems: list[str] = []
    name = wheel.name
    info = f"{project.file_stem}-{release}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta = _metadata(archive.read(f"{info}/METADATA").decode())
        entry_points = (
            archive.read(f"{info}/entry_points.txt").decode()
            if f"{info}/entry_points.txt" in names
            else ""
        )
        licence_files = [n for n in names if n.startswith(f"{info}/") and "LICENSE" in n]
        licence_texts = [archive.read(n).decode() for n in licence_files]
    if meta["Version"] != release:
        problems.append(f"{name}: Version {meta['Version']}, not {release}")
    if canonicalize_name(meta["Name"]) != project.name:
        problems.append(f"{name}: Name {meta['Name']}, not {project.name}")
    if meta["Description-Content-Type"] != "text/markdown":
        problems.append(f"{name}: the long description is not Markdown")
    readme = (project.folder / "README.md").read_text()
    if (meta.get_payload() or "").strip() != readme.strip():
        problems.append(f"{name}: the long description is not {project.relative}/README.md")
    if "MIT" not in (meta["License-Expression"] or meta["License"] or ""):
        problems.append(f"{name}: no MIT licence in its metadata")
    if not licence_texts or any(text != licence for text in licence_texts):
        problems.append(f"{name}: no LICENSE (or another one) in {info}/")
    built = {str(Requirement(line)) for line in meta.get_all("Requires-Dist") or []}
    if built != project.requires_dist():
        problems.append(
            f"{name}: Requires-Dist {sorted(built)}, pyproject.toml says "
            f"{sorted(project.requires_dist())}"
        )
    groups = project.entry_points()
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(entry_points)
    found_groups = {s: {k: v for k, v in parser[s].items()} for s in parser.sections()}
    if found_groups != groups:
        problems.append(f"{name}: entry points {found_groups}, pyproject.toml says {groups}")
    files = {n for n in names if not n.startswith(f"{info}/")}
    wanted = set(project.package_files())
    for missing in sorted(wanted - files):
        problems.append(f"{name}: lacks {missing}")
    for stray in sorted(files - wanted):
        problems.append(f"{name}: holds {stray}, which is no file of its package sources")
    for must in MUST_HOLD.get(project.name, ()):
        if must not in files and must not in wanted:  # (a missing source file of its own)
            problems.append(f"{name}: lacks {must}")
    if any("__pycache__" in n or n.endswith(".pyc") for n in names):
        problems.append(f"{name}: holds bytecode")
    return problems


def _check_sdist(project: Project, sdist: Path, found: list[Project]) -> list[str]:
    problems: list[str] = []
    name = sdist.name
    with tarfile.open(sdist) as archive:
        members = [m.name for m in archive.getmembers() if m.isfile()]
    top = {PurePosixPath(m).parts[0] for m in members}
    if len(top) != 1:
        problems.append(f"{name}: more than one top folder ({sorted(top)})")
        return problems
    (prefix,) = top
    inside = {PurePosixPath(m).relative_to(prefix).as_posix() for m in members}
    for must in ("PKG-INFO", "pyproject.toml", "README.md", "LICENSE"):
        if must not in inside:
            problems.append(f"{name}: lacks {must}")
    for source in sorted(project.package_files().values()):
        if source not in inside:
            problems.append(f"{name}: lacks {source}")
    others = [p for p in found if p is not project and project.folder in p.folder.parents]
    for other in others:
        prefix_other = other.folder.relative_to(project.folder).as_posix() + "/"
        if any(m.startswith(prefix_other) for m in inside):
            problems.append(f"{name}: holds files of {other.name} ({prefix_other})")
    if any("__pycache__" in m or m.endswith(".pyc") for m in inside):
        problems.append(f"{name}: holds bytecode")
    return problems


# -- a new version ----------------------------------------------------------------------------


def bump(new: str) -> list[Path]:
    """Write version ``new`` into _version.py and every pyproject.toml, with its ranges."""
    Version(new)  # a valid version, or an error
    wanted_range = version_range(new)
    changed = []
    text = VERSION_FILE.read_text()
    updated = VERSION_LINE.sub(f'__version__ = "{new}"', text)
    if updated != text:
        VERSION_FILE.write_text(updated)
        changed.append(VERSION_FILE)
    for project in projects():
        path = project.folder / "pyproject.toml"
        text = path.read_text()
        updated = PYPROJECT_VERSION.sub(f'version = "{new}"', text, count=1)
        updated = RANGE_IN_TOML.sub(rf"\g<1>{wanted_range}\g<2>", updated)
        if updated != text:
            path.write_text(updated)
            changed.append(path)
    for relative in DEPENDENTS:  # their own version stays theirs; only the range moves
        path = ROOT / relative
        text = path.read_text()
        updated = RANGE_IN_TOML.sub(rf"\g<1>{wanted_range}\g<2>", text)
        if updated != text:
            path.write_text(updated)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the distributions' folders, one a line")
    commands.add_parser("check", help="versions, ranges, licences and hints in the tree")
    dist = commands.add_parser("check-dist", help="the sdists and wheels in a folder")
    dist.add_argument("dist", type=Path)
    new = commands.add_parser("bump", help="write a new version everywhere")
    new.add_argument("version")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(p.relative for p in projects()))
        return 0
    if args.command == "bump":
        for path in bump(args.version):
            print(f"wrote {path.relative_to(ROOT)}")
        print("now add a CHANGELOG.md section for it: `nox -s build` checks that there is one")
        return 0
    if args.command == "check":
        problems = check_tree()
        summary = f"{len(projects())} distributions at version {version()}"
    else:
        report = check_dist(args.dist)
        problems, summary = report.problems, "; ".join(report.lines)
    for problem in problems:
        print(f"release: {problem}", file=sys.stderr)
    if problems:
        print(f"release: {len(problems)} problem(s); {summary}", file=sys.stderr)
        return 1
    print(f"release: ok, {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
