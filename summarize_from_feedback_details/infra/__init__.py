"""Run infrastructure of the stages, one concern a module: nothing in this package changes a result.

What can change a result (data order, batch arithmetic, masks, losses, advantages, KL, generation
settings, eval metrics) lives in the stage files, where a researcher reads it top to bottom
(DESIGN.md section 1). What is here makes a run start, stop, resume, log and save the same way in
every stage, and is written once:

- `loading`: tokenizers, datasets and models (`load_tokenizer`, `load_split_dataset`, `load_policy`,
  `load_reward_model`), and the frozen reference and reward models under DeepSpeed (`prepare_frozen`);
- `lora`: LoRA and 4-bit plumbing (`with_lora`, `quantization`, `reference_policy`, `saved_form`);
- `preflight`: the refusals before a run builds anything (GPUs torch cannot see, settings that cannot
  work, an output folder in use or holding an earlier run);
- `launch`: `start_run`, the prologue every main() shares, and its `Run`, which brackets the training
  loop; `quiet_libraries`, `make_optimizer`, `gather_global`;
- `checkpoints`: `Checkpoints`, `find_checkpoint` and what a resume must keep (`Resumable`,
  `run_settings`);
- `tracking`: `Logger`, `EarlyWarnings`, `progress` and `PhaseTimer`;
- `saving`: the final save, the disk room it needs, its rescue, and `push_to_hub`;
- `flags`: `parse_args`, with our names for flags that other codebases name differently;
- `cores`: the torch threads a stage takes over, at an update fixed in advance, once the chain beside
  it has ended (hello_world's two chains). Threads change only the order of float sums: a result by
  float noise, which a run's later updates can grow as a seed's difference grows, never by what is
  computed; a fixed update keeps that noise the same on every rerun.

No base classes, callbacks or hooks: plain functions and a few concrete classes that a stage calls
where the reader sees it. Importing a module does nothing but define it: the libraries' noise is
quieted where a run starts (`launch.quiet_libraries`).
"""
