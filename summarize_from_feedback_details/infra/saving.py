"""The final save of a run: nothing here changes a result; a trained model is written whole, or kept.

- `check_disk_space` refuses a run whose model the disk cannot hold (`disk_needs`), before update 1;
- `write_model` writes a model aside and moves it into place once complete; a final save that fails
  names its path and cause and loses nothing (`rescue_model`);
- `push_to_hub`: only with --push_to_hub, no hub call otherwise.
"""

import errno
import os
import shutil
import tempfile
from typing import Optional

from safetensors import SafetensorError


# what a write to a full (or failing) disk raises: OSError from Python's own writes, RuntimeError from
# torch.save ("unexpected pos", "basic_ios::clear"), SafetensorError from safetensors' serializer
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def disk_needs(module) -> tuple:
    """(the final save, one checkpoint) of the trained `module` (unwrapped), in bytes, estimated: the
    saved model's parameters as they are held (PPO saves the policy of its policy + critic; a LoRA
    run its merged model), and a checkpoint's trained parameters with the optimizer's two fp32
    moments (AdamW)."""
    def numel(p) -> int:
        return getattr(p, "ds_numel", p.numel())  # (ZeRO-3 partitions a parameter; ds_numel is its size)

    saved = getattr(module, "policy", module)
    final = sum(numel(p) * p.element_size() for p in saved.parameters())
    trained = [p for p in module.parameters() if p.requires_grad]
    return final, sum(numel(p) * (p.element_size() + 8) for p in trained)


def check_disk_space(output_dir: str, final: int, checkpoint: int, copies: int) -> Optional[str]:
    """Before update 1: refuses a run whose final model (`final` bytes) the disk of `output_dir` cannot
    hold, and returns a warning where `copies` checkpoints (--keep_checkpoints and the one being
    written) of `checkpoint` bytes each would not fit beside it."""
    free = shutil.disk_usage(output_dir).free
    if free < final:
        raise OSError(errno.ENOSPC, f"--output_dir {output_dir}: the trained model needs about {human_bytes(final)} "
                                    f"at the end of the run, and its disk has {human_bytes(free)} free. Free space "
                                    "there or choose another --output_dir")
    if copies and free < final + copies * checkpoint:
        return (f"{output_dir}'s disk has {human_bytes(free)} free; the model and {copies} checkpoints of about "
                f"{human_bytes(checkpoint)} (--keep_checkpoints and the one being written) need about "
                f"{human_bytes(final + copies * checkpoint)}: a checkpoint that does not fit is skipped with a warning "
                "(the last one written is kept)")
    return None


def write_model(module, state_dict: dict, tokenizer, output_dir: str) -> None:
    """`module` with `state_dict`, and `tokenizer`, written aside in <output_dir>/.model.partial and
    moved into `output_dir` once complete: a failed write leaves no half-written model there."""
    partial = os.path.join(output_dir, ".model.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        tokenizer.save_pretrained(partial)
        module.save_pretrained(partial, state_dict=state_dict)  # (safetensors)
        for name in os.listdir(partial):
            os.replace(os.path.join(partial, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def rescue_model(module, state_dict: dict, tokenizer, output_dir: str) -> Optional[str]:
    """Where the trained weights went when the final save to `output_dir` failed: the first of $TMPDIR,
    /dev/shm and the system temp folder with room for them that takes the write, or None where none
    could."""
    needed = sum(t.numel() * t.element_size() for t in state_dict.values())
    for place in dict.fromkeys(p for p in (os.environ.get("TMPDIR"), "/dev/shm", tempfile.gettempdir()) if p):
        try:
            if shutil.disk_usage(place).free < needed:
                continue
            folder = tempfile.mkdtemp(prefix=f"rescued_{os.path.basename(os.path.abspath(output_dir))}_", dir=place)
            write_model(module, state_dict, tokenizer, folder)
            return folder
        except WRITE_ERRORS:
            continue
    return None


def push_to_hub(args, model, tokenizer, state_dict) -> None:
    from huggingface_hub import HfApi

    entity = args.hf_entity or HfApi().whoami()["name"]
    repo_id = f"{entity}/{args.base_model.replace('/', '_')}__{args.exp_name}__tldr"
    tokenizer.push_to_hub(repo_id, revision=args.run_name)
    model.push_to_hub(repo_id, revision=args.run_name, state_dict=state_dict)
    print(f"pushed https://huggingface.co/{repo_id}/tree/{args.run_name}")
