"""The registry of methods, `methods.tsv` beside this file: one row per method trained after SFT and the reward model
(name, run folder and exp_name, label, script, samples per query, its own flags), in the order of the results table
and the plots. hello_world.sh, make compare and the sbatch files read it through sbatches/methods.sh; the results
table (hello_world_report.py) and eval/ read `METHODS`. A new variant is one row (and, for a new algorithm, one
function chosen by its stage's `match`): docs/development.md, "Adding a method". Nothing here changes a result.
"""

import pathlib
import shlex
from dataclasses import dataclass
from typing import Optional

REGISTRY = pathlib.Path(__file__).with_name("methods.tsv")
COLUMNS = ("name", "run", "label", "script", "samples", "flags")


@dataclass(frozen=True)
class Method:
    name: str
    """what ALGOS (and rloo.sbatch's RLOO_METHOD) call it; its model folder"""
    run: str
    """its run folder's suffix (runs/<NAME>_<run>); for a row with samples also its exp_name"""
    label: str
    """its name in the results table and the plots"""
    script: str
    """the stage file that trains it"""
    samples: Optional[int]
    """samples per query, run by hello_world.sh at PPO's episodes per update; None: a stage of its own there"""
    flags: tuple
    """the method's own flags"""

    @property
    def exp_name(self) -> str:
        """What its runs' args.json name it, by which eval/ tells the methods apart: its --exp_name, else its
        script's default, the file name (hello_world.sh names the control's ppo_control in the control's stage)."""
        given = dict(zip(self.flags, self.flags[1:]))
        return given.get("--exp_name", "ppo_control" if self.name == "control" else self.script.removesuffix(".py"))


def check_method(method: Method) -> None:
    """Refuses a row that would train under another method's name: a row run at PPO's episodes must be named as its
    run folder, and by its exp_name, the script's own (its file name) or set with --exp_name."""
    if not (pathlib.Path(__file__).parent / method.script).is_file():
        raise ValueError(f"methods.tsv, {method.name}: no stage file {method.script}")
    if method.samples is None:
        return
    given = dict(zip(method.flags, method.flags[1:]))
    if "--rloo_k" in given and given["--rloo_k"] != str(method.samples):
        raise ValueError(f"methods.tsv, {method.name}: --rloo_k {given['--rloo_k']} but samples {method.samples}")
    if not method.run == method.name == method.exp_name:
        raise ValueError(f"methods.tsv, {method.name}: its run ({method.run}) and exp_name ({method.exp_name}) must "
                         f"be its name (add --exp_name {method.name} to its flags)")


def read_methods(path: pathlib.Path = REGISTRY) -> tuple:
    """The rows of the registry at `path` as Methods, checked: six tab-separated columns, names, runs and labels each
    used once, samples a whole number >= 1 or "-"."""
    methods = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != len(COLUMNS):
            raise ValueError(f"{path}:{number}: {len(fields)} tab-separated fields, not {len(COLUMNS)} "
                             f"({', '.join(COLUMNS)})")
        name, run, label, script, samples, flags = (field.strip() for field in fields)
        if samples != "-" and not (samples.isdigit() and int(samples) >= 1):
            raise ValueError(f"{path}:{number}: samples must be a whole number >= 1 or '-', not {samples!r}")
        method = Method(name, run, label, script, None if samples == "-" else int(samples), tuple(shlex.split(flags)))
        check_method(method)
        methods.append(method)
    for column in ("name", "run", "label"):
        values = [getattr(method, column) for method in methods]
        if len(set(values)) < len(values):
            raise ValueError(f"{path}: two rows share a {column} ({', '.join(values)})")
    return tuple(methods)


METHODS = read_methods()
