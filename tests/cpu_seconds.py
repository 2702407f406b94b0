"""`--cpu-durations=N`: the N tests that took the most CPU, counting the runs they launched.

The suite runs on two cores and is bound by CPU, so a test's wall time (`--durations`) says little
about what it costs: launches side by side overlap, and a test slows while the other worker's
launches take its core. This counts what each phase of a test (set-up, call, tear-down) spent in
CPU seconds: the worker's own (every thread of it) plus its finished child processes, whose own
children (a launcher's ranks) are counted in them once waited for, plus what the launches forked for
it elsewhere cost (tests/forked_launches.py reports them through `count_elsewhere`). It reports per
test, per module and in all, also under pytest-xdist (the numbers travel with the test reports)."""

import resource
import threading
from collections import defaultdict

import pytest

KEY = "cpu_seconds"
# CPU this process caused in processes that are not its children: tests/forked_launches.py's runs,
# forked by a zygote, which reports what each cost
_elsewhere = [0.0]
_elsewhere_lock = threading.Lock()


def count_elsewhere(seconds: float) -> None:
    with _elsewhere_lock:
        _elsewhere[0] += seconds


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _elsewhere[0]


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N test phases with the most CPU seconds, launched runs included (0: all)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.cpu_seconds_mark = cpu_seconds()  # before pytest's own set-up builds the fixtures


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # a test's phases (set-up, call, tear-down) run back to back, each followed at once by its report: a
    # phase's CPU is what was spent since the set-up began or the previous phase's report
    outcome = yield
    now = cpu_seconds()
    outcome.get_result().user_properties.append((KEY, now - item.cpu_seconds_mark))
    item.cpu_seconds_mark = now


def pytest_terminal_summary(terminalreporter, config):
    shown = config.getoption("--cpu-durations")
    if shown is None:
        return
    phases = [(value, report.when, report.nodeid) for reports in terminalreporter.stats.values() for report in reports
              if hasattr(report, "user_properties") for key, value in report.user_properties if key == KEY]
    phases.sort(reverse=True)
    modules = defaultdict(float)
    for value, _, nodeid in phases:
        modules[nodeid.split("::")[0]] += value
    terminalreporter.write_sep("=", f"most CPU seconds (launched runs included): {sum(modules.values()):.0f} s in all")
    for value, when, nodeid in phases[:shown or None]:
        terminalreporter.write_line(f"{value:8.2f}s {when:<8} {nodeid}")
    terminalreporter.write_line("by module:")
    for module, value in sorted(modules.items(), key=lambda pair: -pair[1]):
        terminalreporter.write_line(f"{value:8.1f}s {module}")
