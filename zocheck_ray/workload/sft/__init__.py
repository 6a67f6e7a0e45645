"""Task kind `sft`: TRL's four dataset formats, each row checked (`rows.py`), prepared as TRL's `SFTTrainer`
prepares it (`prepare.py`), and trained and evaluated on (`task.py`); `build_task` runs them as its stages'
parts."""
