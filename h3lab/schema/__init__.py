"""The settings schema: every user setting declared once; the CLI, the REPL commands, the panel and the summary are
generated from it (as torchtitan's job-config dataclasses generate its CLI).

Declare a setting (a value of each generation, held by `GenerationSettings`) in the module that owns it:

    from h3lab.schema import Control, Repl, Setting, declare

    declare(Setting(
        "noise_level", float, 0.7, "SDE noise level of the stepper", bounds=(0.0, 2.0),
        command=Repl(),                                  # !noise-level X          (defaults follow the type)
        control=Control("noise", row="stepper"),         # a FloatText in a new panel row
        summary=lambda v: f"noise {v:g}" if v != 0.7 else None,
        spec=lambda v, s: {"stepper_args": {"noise_level": v}},   # RunSpec keyword arguments it contributes
    ))

That one declaration gives `--noise-level X` (for the actions in `actions`, default one-shot and the REPL),
`!noise-level X`, a panel control, a part of `settings.summary()`, `settings.noise_level` (the default until set),
`settings.replace(noise_level=0.5)` validated by the type, `choices`, `bounds` and `rule(value, settings) -> notices`
(one-line `ValidationError`s), and, through `spec`, its place in the run's `RunSpec` (`pipeline.build_spec`). Add the
declaring module to `SETTINGS.modules` (`setting.py`) unless something imports it before a front end starts.
A session option (a `Session(...)` keyword, read once from its flag) is `Setting(..., target="session",
actions=("one-shot", "repl", "replay"))`: `cli.session_from_args` passes it on when the flag is given.

Fields of `GenerationSettings` itself (seed, size, steps, mode, the presets, ...) are declared here too
(`builtin.py`, the presets' files) with their flags, commands, controls and summary parts; their rules stay in
`GenerationSettings.__post_init__` (`h3lab.schema.generation_settings`), which checks them in a fixed order with the texts users see.
The schema's `rule`/`bounds` apply to the settings declared only here (extras). `Setting.command` and `.control`
may customise every part (usage, parser, reply, the session check; `h3lab.schema.words` holds the word parsers).

The flags of the other command lines (`h3lab train`, `train grpo`, `train nft`, `h3lab encode`, the CLI's
infrastructure flags) are `Setting`s too, of target "command", declared with `declare_flag` into the program
registries `PROGRAMS` (`program.py`): one declaration gives the argparse flag (on every program it names), its help
with the default, the config keyword a `SettingError` is named by (`--group 1: must be an integer >= 2`) and the
record the value is sealed in (`seal`):

    from h3lab.schema import Setting, declare_flag

    declare_flag(Setting("group", int, 4, "rollouts per prompt", target="command", metavar="G",
                         programs=("train grpo", "train nft"), seal="config"))

Modules: `setting.py` (`Setting`, `Repl`, `Control`, the registry `SETTINGS`), `words.py` (REPL word parsers),
`builtin.py` (the generation settings of `h3lab.schema.generation_settings`), `argv.py` (argparse flags and the flag -> settings
conversion), `program.py` (the command lines' registries, their argparse flags, the sealed fields of parsed flags),
`train_flags.py`, `encode_flags.py`, `cli_flags.py` (the declared flags of `h3lab train`, `h3lab encode` and the
CLI). May import: errors, settings, runtime (builtin and argv only; `setting.py`, `program.py` and `words.py` import
nothing of h3lab but errors, so `h3lab.schema.generation_settings` and the presets can declare at import); the three flag modules
belong to the front ends' room (they read names of the training room and the runtime).
"""

from .program import PROGRAMS, declare_flag
from .setting import ACTIONS, NO_VALUE, SETTINGS, TARGETS, Control, Repl, Schema, Setting, declare

__all__ = ["ACTIONS", "NO_VALUE", "PROGRAMS", "SETTINGS", "TARGETS", "Control", "Repl", "Schema", "Setting", "declare",
           "declare_flag"]
