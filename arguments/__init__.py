"""Command-line arguments: Megatron-LM flag names (plus DeepSpeed's), converted once into configs.

This is the only module that touches argparse, and nothing under `app/` imports it.
`parse_args` (`arguments/flags.py`) returns the raw namespace; `build_run_config` (`arguments/convert.py`) turns it into an
`app.config.RunConfig` once, filling derived defaults. The rules themselves live in the config
dataclasses (one home each), whose messages name the flags and their values.

Both spellings are accepted where DeepSpeedExamples' Megatron-LM and current Megatron-LM differ;
the pairs share one `dest`, so either spelling sets the same value:

=============================  ==============================
DeepSpeedExamples name          current Megatron-LM name
=============================  ==============================
--model-parallel-size           --tensor-model-parallel-size
--batch-size                    --micro-batch-size
--intermediate-size             --ffn-hidden-size
--warmup (fraction)             --lr-warmup-fraction
--min-scale                     --min-loss-scale
--local_rank                    --local-rank
=============================  ==============================
"""
from __future__ import annotations

from arguments.convert import build_run_config, config_from_argv
from arguments.flags import build_parser, format_args, parse_args

__all__ = ["build_parser", "build_run_config", "config_from_argv", "format_args", "parse_args"]
