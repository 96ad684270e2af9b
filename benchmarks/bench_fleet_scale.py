#!/usr/bin/env python3
"""Measure how provisioning scales with the fleet: `site.yml` on 1 host against 3 hosts, first run and re-run.

Four timed runs of ``ansible-playbook -i INVENTORY site.yml -e sparkfleet_profile=PROFILE``:

1. provision, 1 host  (``--limit spark-01``)
2. re-run,    1 host  (the same; a converged host: nothing should change)
3. provision, 3 hosts (``--limit spark-01,spark-02,spark-03``)
4. re-run,    3 hosts

Each run's wall-clock time, exit code and per-host recap (ok/changed/failed) are recorded; the
JSON goes to ``results/fleet-scale/<UTC stamp>.json`` and ``docs/fleet-scale.md`` is rendered
from it (``--render RESULT.json`` re-renders a saved measurement).

A "provision" is only a first install on fresh hosts. With ``--fresh`` (sandbox inventory only)
the sandbox fleet is purged and booted again before runs 1 and 3 (``tests/sandbox/fleet.py down
--purge`` and ``up``), so both provisions start from bare hosts. Without it, run 3 finds spark-01
already converged, and the document says so. ``--fresh`` destroys every sandbox host's state: run it
only when nobody else uses the fleet.

    python benchmarks/bench_fleet_scale.py --dry-run           # print the commands, run nothing
    python benchmarks/bench_fleet_scale.py --fresh             # measure (minutes), write the doc
    python benchmarks/bench_fleet_scale.py --render results/fleet-scale/20260624T100000Z.json

Exit codes: 0 measured (and the doc written), 1 a run failed (nothing written), 2 bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SANDBOX_INVENTORY = "inventory/sandbox"
FLEET_SCRIPT = "tests/sandbox/fleet.py"
RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
    r"\s+failed=(?P<failed>\d+)\s+skipped=(?P<skipped>\d+)"
)
TIMER = re.compile(r"^sparkfleet_timer: \S+ took (?P<seconds>[0-9.]+) s", re.MULTILINE)
SCHEMA = "sparkfleet-fleet-scale/1"


class ScaleError(Exception):
    """Bad input, or a run that failed: one line."""


@dataclass(frozen=True)
class Phase:
    name: str  # provision-1, rerun-1, provision-3, rerun-3
    kind: str  # provision | rerun
    hosts: tuple[str, ...]


@dataclass
class PhaseResult:
    name: str
    kind: str
    hosts: list[str]
    command: list[str]
    wall_s: float
    returncode: int
    recap: dict[str, dict[str, int]] = field(default_factory=dict)
    ansible_timer_s: float | None = None
    # the sparkfleet_timer callback's account: seconds per role and the slowest tasks
    per_role_s: dict[str, float] = field(default_factory=dict)
    slowest_tasks: list[dict[str, Any]] = field(default_factory=list)
    reset_before: bool = False


def plan_phases(one: str, all_hosts: list[str]) -> list[Phase]:
    """The four runs, in order."""
    if one not in all_hosts:
        raise ScaleError(
            f"--one {one!r} is not one of --hosts {','.join(all_hosts)}; the single host must be in the fleet"
        )
    return [
        Phase("provision-1", "provision", (one,)),
        Phase("rerun-1", "rerun", (one,)),
        Phase(f"provision-{len(all_hosts)}", "provision", tuple(all_hosts)),
        Phase(f"rerun-{len(all_hosts)}", "rerun", tuple(all_hosts)),
    ]


def playbook_command(args: argparse.Namespace, phase: Phase) -> list[str]:
    return [
        str(Path(args.ansible_playbook)),
        "-i",
        args.inventory,
        args.playbook,
        "--limit",
        ",".join(phase.hosts),
        "-e",
        f"sparkfleet_profile={args.profile}",
        *shlex.split(args.extra_args),
    ]


def reset_commands(host_count: int) -> list[list[str]]:
    """Purge and boot the sandbox fleet (fresh hosts)."""
    python = sys.executable
    return [
        [python, FLEET_SCRIPT, "down", "--purge"],
        [python, FLEET_SCRIPT, "up", "--hosts", str(host_count)],
    ]


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    recap = {}
    for line in output.splitlines():
        match = RECAP.match(line.strip())
        if match:
            recap[match["host"]] = {k: int(v) for k, v in match.groupdict().items() if k != "host"}
    return recap


def parse_timer(output: str) -> float | None:
    """The playbook's own wall time, from the sparkfleet_timer callback's line (the last play's)."""
    matches = TIMER.findall(output)
    return float(matches[-1]) if matches else None


def timer_account(path: Path) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Seconds per role and the five slowest tasks, from the callback's JSON line (SPARKFLEET_TIMER_JSON)."""
    if not path.is_file() or not path.read_text().strip():
        return {}, []
    run = json.loads(path.read_text().strip().splitlines()[-1])
    per_role = {role: round(seconds, 1) for role, seconds in run["per_role"].items()}  # slowest first
    slowest = sorted(run["tasks"], key=lambda t: -t["seconds"])[:5]
    return per_role, slowest


def ansible_env() -> dict[str, str]:
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }


def run_phase(args: argparse.Namespace, phase: Phase, reset: bool) -> PhaseResult:
    if reset:
        for command in reset_commands(len(args.hosts)):
            print(f"==> {shlex.join(command)}", flush=True)
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=900)
            if proc.returncode != 0:
                tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
                raise ScaleError(f"`{shlex.join(command)}` failed: {tail[0]}")
    command = playbook_command(args, phase)
    print(f"==> [{phase.name}] {shlex.join(command)}", flush=True)
    timer_json = ROOT / args.results_dir / f".{phase.name}.timer.json"
    timer_json.parent.mkdir(parents=True, exist_ok=True)
    timer_json.unlink(missing_ok=True)
    env = {**ansible_env(), "SPARKFLEET_TIMER_JSON": str(timer_json)}
    started = time.monotonic()
    lines: list[str] = []
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(("PLAY ", "TASK ", "RUNNING HANDLER")):
                elapsed = time.monotonic() - started
                print(f"    {elapsed:7.1f} s  {line.strip()[:100]}", flush=True)
        returncode = proc.wait()
    wall = time.monotonic() - started
    output = "".join(lines)
    per_role, slowest = timer_account(timer_json)
    timer_json.unlink(missing_ok=True)
    result = PhaseResult(
        name=phase.name,
        kind=phase.kind,
        hosts=list(phase.hosts),
        command=command,
        wall_s=round(wall, 2),
        returncode=returncode,
        recap=parse_recap(output),
        ansible_timer_s=parse_timer(output),
        per_role_s=per_role,
        slowest_tasks=slowest,
        reset_before=reset,
    )
    changed = ", ".join(f"{h} changed={r['changed']}" for h, r in result.recap.items())
    print(f"    {phase.name}: {wall:.1f} s, rc {returncode}; {changed}", flush=True)
    if returncode != 0:
        log = ROOT / args.results_dir / f"{phase.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output, encoding="utf-8")
        raise ScaleError(f"{phase.name} failed (rc {returncode}); its output is in {display_path(log)}")
    return result


def ops_status_timing(args: argparse.Namespace, hosts: list[str]) -> dict[str, Any]:
    """Wall time of the read-only `sparkfleet ops status` over ``hosts`` (its per-host work runs in parallel)."""
    command = [sys.executable, "-m", "sparkfleet", "ops", "status", "-i", args.inventory, "-l", ",".join(hosts)]
    print(f"==> {shlex.join(command)}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(
        command, cwd=ROOT, env=ansible_env(), capture_output=True, text=True, check=False, timeout=600
    )
    wall = time.monotonic() - started
    print(f"    ops status over {len(hosts)} host(s): {wall:.1f} s, rc {proc.returncode}", flush=True)
    if proc.returncode not in (0, 1):  # 1: a host is unhealthy, still a complete answer
        raise ScaleError(f"`{shlex.join(command)}` failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return {"hosts": hosts, "wall_s": round(wall, 2), "returncode": proc.returncode}


def environment_facts(args: argparse.Namespace) -> dict[str, Any]:
    def quiet(command: list[str]) -> str:
        try:
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
        except OSError:
            return ""
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""

    return {
        "utc_time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": quiet(["git", "describe", "--always", "--dirty", "--abbrev=7"]),  # -dirty: uncommitted changes
        "ansible": quiet([str(Path(args.ansible_playbook)), "--version"]),
        "controller_cpus": os.cpu_count(),
        "controller": f"{platform.system()} {platform.machine()}",
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
        "inventory": args.inventory,
        "playbook": args.playbook,
        "profile": args.profile,
        "fresh": args.fresh,
        "extra_args": args.extra_args,
        "argv": args.argv,
    }


def display_path(path: Path) -> str:
    """A path relative to the repo root when it is inside it (documents name no machine paths)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def ratio(numerator: float | None, denominator: float | None) -> str:
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}×"


def render_doc(measurement: dict[str, Any]) -> str:
    """docs/fleet-scale.md from a measurement (only measured figures; nothing typed in)."""
    facts = measurement["environment"]
    phases = {p["name"]: p for p in measurement["phases"]}
    results = measurement["phases"]
    one = next(p for p in results if p["kind"] == "provision")
    many = [p for p in results if p["kind"] == "provision"][-1]
    n_one, n_many = len(one["hosts"]), len(many["hosts"])
    rerun_one = phases.get(f"rerun-{n_one}")
    rerun_many = phases.get(f"rerun-{n_many}")
    lines = [
        "# Fleet scale: provisioning 1 host against 3",
        "",
        "<!-- Generated by benchmarks/bench_fleet_scale.py from a measurement; do not edit by hand. -->",
        "",
        f"Measured {facts['utc_time']} at commit `{facts['git_commit']}` on a {facts['controller']} controller "
        f"with {facts['controller_cpus']} CPU(s) (load average at start {facts['load_average_at_start']}); "
        f"inventory `{facts['inventory']}`, profile `{facts['profile']}`, `{facts['ansible']}`.",
        "",
        "Command: `"
        + shlex.join(["python", "benchmarks/bench_fleet_scale.py", *facts.get("argv", [])])
        + "`; each row is "
        "one `ansible-playbook " + facts["playbook"] + " --limit HOSTS` run, timed wall-clock on the controller.",
        "",
        "| run | hosts | wall time (s) | changed per host | fresh hosts |",
        "|---|---|---:|---|---|",
    ]
    for phase in results:
        changed = ", ".join(f"{h} {r['changed']}" for h, r in sorted(phase["recap"].items()))
        lines.append(
            f"| {phase['name']} | {len(phase['hosts'])} | {phase['wall_s']:.1f} | {changed} | "
            f"{'yes' if phase['reset_before'] else ('-' if phase['kind'] == 'rerun' else 'no')} |"
        )
    lines += [
        "",
        "| | 1 host (s) | " + f"{n_many} hosts (s) | {n_many} hosts / 1 host | speed-up over {n_many} serial runs |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, single, fleet in (("provision", one, many), ("re-run", rerun_one, rerun_many)):
        if not single or not fleet:
            continue
        serial = single["wall_s"] * n_many
        growth, speedup = ratio(fleet["wall_s"], single["wall_s"]), ratio(serial, fleet["wall_s"])
        lines.append(f"| {label} | {single['wall_s']:.1f} | {fleet['wall_s']:.1f} | {growth} | {speedup} |")
    ops_runs = measurement.get("ops_status") or []
    if len(ops_runs) == 2:
        single, fleet = ops_runs
        lines += [
            "",
            f"`sparkfleet ops status` (read-only, one SSH connection per host, in parallel): "
            f"{single['wall_s']:.1f} s for {len(single['hosts'])} host, {fleet['wall_s']:.1f} s for "
            f"{len(fleet['hosts'])} hosts ({ratio(fleet['wall_s'], single['wall_s'])}).",
        ]
    accounted = [p for p in results if p.get("per_role_s")]
    if accounted:
        roles = list(dict.fromkeys(r for p in accounted for r in p["per_role_s"]))
        lines += [
            "",
            "Where each run spent its time (the `sparkfleet_timer` callback: a task's time runs from the first "
            "host starting it to the last host finishing it, so a run's task times add up to its wall time):",
            "",
            "| role | " + " | ".join(f"{p['name']} (s)" for p in accounted) + " |",
            "|---|" + "---:|" * len(accounted),
        ]
        for role in roles:
            cells = " | ".join(f"{p['per_role_s'].get(role, 0.0):.1f}" for p in accounted)
            lines.append(f"| {role} | {cells} |")
        lines += ["", "Slowest tasks:", ""]
        for phase in accounted:
            tasks = "; ".join(f"{t['name']} {t['seconds']:.1f} s" for t in phase["slowest_tasks"][:3])
            lines.append(f"- {phase['name']}: {tasks}")
    lines += ["", "## Reading it", ""]
    if not facts["fresh"]:
        lines += [
            f"- Measured without `--fresh`: the {n_many}-host provision found {one['hosts'][0]} already converged by "
            "the 1-host runs, so it is a provision of the others plus a re-run of that one.",
        ]
    lines += [
        "- The hosts of one run are worked on in parallel (`forks` in ansible.cfg is larger than the fleet); "
        "a ratio near 1× means the fleet costs no more than one host, a ratio near "
        f"{n_many}× means the work is serialised somewhere (the controller's CPUs, a shared download or a "
        "`run_once`/`serial` step).",
        "- A re-run should report `changed 0` for every host (idempotence); its time is the fixed cost of "
        "checking a converged fleet, the floor for `make drift`.",
        "- The sandbox hosts share the controller's CPUs, so the sandbox over-states what 3 real Sparks cost "
        "(each of them has its own CPU, disk and network path).",
        "",
        "Re-render from the saved JSON: `python benchmarks/bench_fleet_scale.py --render "
        f"{measurement.get('saved_as', 'results/fleet-scale/<stamp>.json')}`.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_fleet_scale.py", description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("-i", "--inventory", default=SANDBOX_INVENTORY, help=f"inventory (default {SANDBOX_INVENTORY})")
    parser.add_argument("--playbook", default="site.yml", help="playbook to time (default site.yml)")
    parser.add_argument("--profile", default="dflash", help="sparkfleet_profile to deploy (default dflash)")
    parser.add_argument("--one", default="spark-01", help="the single host (default spark-01)")
    parser.add_argument(
        "--hosts", default="spark-01,spark-02,spark-03", help="the fleet, comma-separated (default spark-01..03)"
    )
    parser.add_argument("--extra-args", default="", help="more ansible-playbook arguments, one shell string")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="purge and re-boot the SANDBOX fleet before each provision (destroys host state)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands in order and run nothing")
    parser.add_argument(
        "--skip-ops", action="store_true", help="do not time `sparkfleet ops status` (1 host, all hosts)"
    )
    parser.add_argument("--doc", default="docs/fleet-scale.md", help="document to write (default docs/fleet-scale.md)")
    parser.add_argument("--render", metavar="RESULT_JSON", help="only re-render --doc from a saved measurement")
    parser.add_argument(
        "--results-dir",
        default="results/fleet-scale",
        help="where the measurement JSON goes (default results/fleet-scale)",
    )
    parser.add_argument(
        "--ansible-playbook",
        default=str(Path(sys.executable).with_name("ansible-playbook")),
        help="ansible-playbook to run (default: the one next to this Python)",
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if len(args.hosts) < 2:
        parser.error(f"--hosts {','.join(args.hosts)!r}: name at least two hosts to compare with one")
    if args.fresh and Path(args.inventory).as_posix().rstrip("/") != SANDBOX_INVENTORY:
        parser.error(f"--fresh purges the sandbox fleet; it cannot reset {args.inventory!r} (use {SANDBOX_INVENTORY})")
    try:
        args.phases = plan_phases(args.one, args.hosts)
    except ScaleError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = ROOT / args.doc
    try:
        if args.render:
            measurement = json.loads(Path(args.render).read_text(encoding="utf-8"))
            if measurement.get("schema") != SCHEMA:
                raise ScaleError(f"{args.render}: schema {measurement.get('schema')!r} is not {SCHEMA!r}")
            doc.write_text(render_doc(measurement), encoding="utf-8")
            print(f"wrote {args.doc} from {args.render}")
            return 0
        phases = args.phases
        if args.dry_run:
            for phase in phases:
                if args.fresh and phase.kind == "provision":
                    for command in reset_commands(len(args.hosts)):
                        print(shlex.join(command))
                print(shlex.join(playbook_command(args, phase)))
            if not args.skip_ops:
                for hosts in ([args.one], args.hosts):
                    print(
                        shlex.join(
                            [
                                sys.executable,
                                "-m",
                                "sparkfleet",
                                "ops",
                                "status",
                                "-i",
                                args.inventory,
                                "-l",
                                ",".join(hosts),
                            ]
                        )
                    )
            print(f"# then: write {args.results_dir}/<stamp>.json and {args.doc}")
            return 0
        if not Path(args.ansible_playbook).exists():
            raise ScaleError(f"{args.ansible_playbook} not found: run `make venv` or pass --ansible-playbook")
        environment = environment_facts(args)
        results = [run_phase(args, phase, reset=args.fresh and phase.kind == "provision") for phase in phases]
        ops_timings = (
            [] if args.skip_ops else [ops_status_timing(args, [args.one]), ops_status_timing(args, args.hosts)]
        )
    except (ScaleError, OSError, json.JSONDecodeError) as exc:
        print(f"bench_fleet_scale: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, json.JSONDecodeError | OSError) else 1
    stamp = environment["utc_time"].replace("-", "").replace(":", "")
    saved = ROOT / args.results_dir / f"{stamp}.json"
    measurement = {
        "schema": SCHEMA,
        "environment": environment,
        "phases": [asdict(r) for r in results],
        "ops_status": ops_timings,
        "saved_as": display_path(saved),
    }
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(measurement, indent=2) + "\n", encoding="utf-8")
    doc.write_text(render_doc(measurement), encoding="utf-8")
    times = ", ".join(f"{r.name} {r.wall_s:.0f} s" for r in results)
    print(f"fleet scale: {times}; wrote {display_path(saved)} and {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
