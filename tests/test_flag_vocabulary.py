"""One flag vocabulary: a concept the command-line trainers share is spelt the same way in every
one of them, with dashes (--max-steps, --batch-size, ...); its underscore spelling and its older
names (--steps, --context-length, ...) still parse, to the same dest and value, so every command
printed on a page or in a cluster script keeps working; and a bad value is still the one-line
error, naming the dashed flag. The parsers are built as the trainers build them and caught
before they parse: nothing trains."""

import importlib

import pytest

from snippets.flags import Parser

pytestmark = pytest.mark.kernel_independent("command-line parsing: flag names, values, messages")

# The command-line trainers (each builds its parser in parse_args, or in main).
TRAINERS = [
    "snippets.training.ddp_trainer",
    "snippets.training.fsdp_trainer",
    "snippets.training.parallel_trainer",
    "snippets.scripts.train_tiny_transformer",
    "snippets.scripts.ddp_simulation_train",
    "snippets.library.accelerate_train",
    "snippets.scripts.low_precision",
    "snippets.labs.lab1_sweep",
    "snippets.scripts.profile_step",
    "snippets.scripts.precision_and_accumulation",
    "snippets.cluster.multi_node_train",
    "snippets.cluster.deepspeed.train_deepspeed",
]

# The shared concepts: canonical flag -> its other names (the underscore spelling is implied).
VOCABULARY = {
    "--max-steps": ["--steps"],
    "--batch-size": [],
    "--grad-accum-steps": [],
    "--seq-len": ["--context-length", "--context"],
    "--model-size": [],
    "--lr": [],
    "--min-lr": [],
    "--warmup-steps": [],
    "--weight-decay": [],
    "--grad-clip": [],
    "--seed": [],
    "--ckpt-every": [],
    "--keep-last": [],
    "--log-every": [],
    "--eval-every": [],
    "--sharding-strategy": [],
    "--shard-group-size": [],
    "--mixed-precision": [],
    "--cpu-offload": [],
}

# Older names that commands on the pages and in snippets/cluster still use, per trainer.
OLD_NAMES = {
    "snippets.scripts.ddp_simulation_train": ["--steps"],
    "snippets.library.accelerate_train": ["--steps"],
    "snippets.scripts.low_precision": ["--steps"],
    "snippets.labs.lab1_sweep": ["--steps", "--context-length"],
    "snippets.scripts.train_tiny_transformer": ["--context-length"],
    "snippets.cluster.multi_node_train": ["--steps"],
    "snippets.cluster.deepspeed.train_deepspeed": ["--steps", "--context"],
}

# The same word for another concept: profile_step's --steps counts the steps it records.
OTHER_CONCEPT = {("snippets.scripts.profile_step", "--steps")}

GOOD_VALUE = {"--lr": "0.002", "--min-lr": "0.0001", "--weight-decay": "0.05",
              "--grad-clip": "0.5", "--model-size": "tiny"}


def underscored(flag: str) -> str:
    return "--" + flag[2:].replace("-", "_")


CONCEPT_OF = {name: canonical for canonical, names in VOCABULARY.items()
              for name in [canonical, underscored(canonical), *names,
                           *map(underscored, names)]}


class _Built(Exception):
    def __init__(self, parser):
        self.parser = parser


def build(module_name: str) -> Parser:
    """The trainer's parser, exactly as its parse_args (or main) builds it, caught when it
    would parse."""
    module = importlib.import_module(module_name)
    entry = getattr(module, "parse_args", None)
    if getattr(entry, "__module__", None) != module_name:  # none, or another module's
        entry = module.main

    def caught(self, *args, **kwargs):
        raise _Built(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Parser, "parse_args", caught)
        with pytest.raises(_Built) as built:
            entry([])
    return built.value.parser


def concepts(module_name: str, parser) -> dict:
    """canonical flag -> the action the trainer registered for that concept."""
    found = {}
    for action in parser._actions:
        for shown in action.option_strings:  # what --help and the errors print
            if shown in CONCEPT_OF and (module_name, shown) not in OTHER_CONCEPT:
                found[CONCEPT_OF[shown]] = action
    return found


def value_for(canonical: str, action) -> list[str]:
    if action.nargs == 0:  # a switch
        return []
    if action.choices:
        return [next(str(c) for c in action.choices if c != action.default)]
    return [GOOD_VALUE.get(canonical, "7")]


@pytest.fixture(scope="module", params=TRAINERS, ids=lambda m: m.split(".")[-1])
def trainer(request):
    return request.param, build(request.param)


def test_every_shared_concept_is_spelt_the_canonical_way(trainer):
    module_name, parser = trainer
    for action in parser._actions:
        for shown in action.option_strings:
            concept = CONCEPT_OF.get(shown)
            if concept is None or (module_name, shown) in OTHER_CONCEPT:
                continue
            assert action.option_strings == [concept], (
                f"{module_name}: {'/'.join(action.option_strings)} is the concept {concept}: "
                f"add it with Parser.add_flag({concept[2:]!r}, ...), so it is spelt {concept} "
                "and the other spellings are still accepted")
    help_text = parser.format_help()
    for concept in concepts(module_name, parser):
        for other in [underscored(concept), *VOCABULARY[concept]]:
            if other != concept:
                assert f"{other} " not in help_text and f"{other}\n" not in help_text, (
                    f"{module_name} --help shows {other}; it shows only {concept}")


def test_trainers_share_concepts():
    """The vocabulary is shared: the main concepts appear in several trainers, each time
    under the same flag (checked above), not once each under different names."""
    seen = {}
    for module_name in TRAINERS:
        for concept in concepts(module_name, build(module_name)):
            seen.setdefault(concept, []).append(module_name.split(".")[-1])
    assert len(seen["--max-steps"]) >= 7, seen["--max-steps"]
    assert len(seen["--batch-size"]) >= 8, seen["--batch-size"]
    assert len(seen["--seq-len"]) >= 4, seen["--seq-len"]


def test_other_spellings_parse_to_the_same_dest_and_value(trainer):
    module_name, parser = trainer
    found = concepts(module_name, parser)
    for concept, action in found.items():
        value = value_for(concept, action)
        expected = vars(parser.parse_args([concept, *value]))
        assert expected[action.dest] != action.default  # the value was read, not defaulted
        other = underscored(concept)
        assert vars(parser.parse_args([other, *value])) == expected, (module_name, other)
    for old in OLD_NAMES.get(module_name, []):
        concept = CONCEPT_OF[old]
        action = found[concept]
        value = value_for(concept, action)
        canonical = vars(parser.parse_args([concept, *value]))
        assert vars(parser.parse_args([old, *value])) == canonical, (module_name, old)


def test_bad_value_is_one_line_naming_the_canonical_flag(trainer, capsys):
    module_name, parser = trainer
    checked = 0
    for concept, action in concepts(module_name, parser).items():
        if action.nargs == 0 or (action.type is None and not action.choices):
            continue  # a switch, or free text (a config name or a path)
        for typed in dict.fromkeys([concept, underscored(concept)]):
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args([typed, "nonsense"])
            assert exit_.value.code == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            message = err.split(": error: ", 1)[1]
            assert message.startswith(f"argument {concept}: "), (module_name, typed, message)
            checked += 1
    assert checked or not concepts(module_name, parser), module_name
