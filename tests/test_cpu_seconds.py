"""`--cpu-durations` (tests/cpu_seconds.py) counts a launched run's CPU in the test that launched it,
and a test that waits costs next to nothing."""

import os
import re

BUSY_TESTS = '''
import subprocess
import sys
import time

BURN = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"


def test_launches():
    subprocess.run([sys.executable, "-c", BURN], check=True)


def test_burns_in_process():
    end = time.process_time() + 1.0
    while time.process_time() < end:
        pass


def test_waits():
    time.sleep(1.0)
'''


def test_a_launched_run_counts_in_its_test(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    pytester.makepyfile(test_busy=BUSY_TESTS)
    result = pytester.runpytest_subprocess("-p", "cpu_seconds", "--cpu-durations=0")
    result.assert_outcomes(passed=3)
    seconds = {}
    for line in result.outlines:
        match = re.fullmatch(r"\s*([\d.]+)s (setup|call|teardown)\s+test_busy\.py::(\w+)", line)
        if match:
            seconds[match[3], match[2]] = float(match[1])
    assert seconds["test_launches", "call"] >= 0.95 and seconds["test_burns_in_process", "call"] >= 0.95, seconds
    assert seconds["test_waits", "call"] < 0.2, seconds
    total = float(re.search(r"most CPU seconds \(launched runs included\): (\d+) s in all", result.stdout.str())[1])
    assert total >= 2, result.stdout.str()
    module = [line for line in result.outlines if line.endswith(" test_busy.py")]
    assert len(module) == 1 and float(module[0].split("s ")[0]) >= 1.9, result.outlines
