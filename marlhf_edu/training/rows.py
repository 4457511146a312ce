"""The rows a trl stage trains on: toy or dataset rows, capped (`select_rows`), extended with a file's rows
(`with_file_rows`), and checked against the token limits trl would otherwise cut silently (`check_lengths`)."""

from __future__ import annotations

from marlhf_edu.data.formats import load_preferences, load_sft
from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.errors import BadRowError, ConfigError


def select_rows(dataset, tokenizer, script_args, kind: str):
    """Apply `max_tokens` and `max_rows` to a prompt/completion or preference dataset, and print what was kept:
    a filter the user asked for, reported, so nothing is dropped silently."""
    total = len(dataset)
    if script_args.max_tokens:
        answers = [k for k in ("completion", "chosen", "rejected") if k in dataset.column_names]
        prompt = [len(ids) for ids in tokenizer(list(dataset["prompt"]))["input_ids"]]
        longest = [0] * total
        for key in answers:  # tokenized in one batched call per column
            longest = [max(n, len(ids)) for n, ids in
                       zip(longest, tokenizer(list(dataset[key]), add_special_tokens=False)["input_ids"])]
        keep = [i for i in range(total) if prompt[i] + longest[i] + 1 <= script_args.max_tokens]  # + EOS
        dataset = dataset.select(keep)
    if script_args.max_rows:
        dataset = dataset.select(range(min(script_args.max_rows, len(dataset))))
    if len(dataset) < total:
        print(f"{kind} data: using {len(dataset)} of {total} rows (max_tokens={script_args.max_tokens or 'off'}, "
              f"max_rows={script_args.max_rows or 'off'})")
    if not len(dataset):
        raise ConfigError(f"{kind} data: no rows left after max_tokens={script_args.max_tokens}")
    return dataset


def append_rows(dataset, extra: list[dict], tokenizer, script_args, what: str, detail: str):
    """`dataset` + the `extra` rows that fit in `max_tokens`, with how many were added printed (preference pairs
    get margin 0 where there is a `margin` column: the pair's rating was for another answer)."""
    from dataclasses import replace

    import datasets

    if "margin" in dataset.column_names:
        extra = [{**p, "margin": 0.0} for p in extra]  # a margin rated another answer
    extra = [{k: p[k] for k in dataset.column_names} for p in extra]
    before = len(extra)
    extra = select_rows(datasets.Dataset.from_list(extra, features=dataset.features), tokenizer,
                        replace(script_args, max_rows=0), what)  # max_rows counted the dataset's rows, not these
    unit = "pairs" if "chosen" in dataset.column_names else "rows"
    print(f"{what}s: added {len(extra)} of {before} candidates ({detail}) to {len(dataset)} {unit}")
    return datasets.concatenate_datasets([dataset, extra])


def with_file_rows(dataset, tokenizer, script_args, key: str, what: str, load):
    """`dataset` followed by the rows of the local file named by `script_args.<key>` (read by `load(path)`) that
    fit in `max_tokens` (those that do not are left out as the dataset's are, and counted in the printed line).
    A bad row is an error naming the key, the file, the row and the field: these rows were written on purpose,
    so `skip_bad_rows` does not apply to them."""
    path = getattr(script_args, key)
    try:
        extra = load(path).to_list()
    except BadRowError as err:
        raise err.refused_in(f"{key} {path}", hint="fix the row: these rows are never skipped") from None
    return append_rows(dataset, extra, tokenizer, script_args, what, f"from {path}")


def load_preference_data(script_args, tokenizer=None, split: str | None = None):
    """The toy world's preference pairs, or a dataset's (`split` overrides `dataset_split`), rendered with the
    tokenizer's chat template when it has one."""
    if script_args.dataset_name == "toy":
        return ToyWorld(ToyWorldConfig(seed=script_args.toy_seed)).preference_dataset()
    return load_preferences(script_args.dataset_name, script_args.dataset_format,
                            split=split or script_args.dataset_split, skip_bad_rows=script_args.skip_bad_rows,
                            tokenizer=tokenizer)


def check_lengths(dataset, tokenizer, max_length: int | None):
    """trl drops preference pairs longer than `max_length`, and cuts SFT rows (and their EOS) to it, without a
    word; we refuse to, and say which rows."""

    if max_length is None:
        return
    too_long = [i for i, row in enumerate(dataset)
                if max(len(tokenizer(row["prompt"] + row[k])["input_ids"])
                       for k in ("completion", "chosen", "rejected") if k in row) + 1 > max_length]
    if too_long:
        raise ConfigError(f"{len(too_long)} row(s) exceed max_length={max_length} tokens (first rows: "
                          f"{too_long[:5]}); raise max_length, or keep the rows that fit with max_tokens")


def load_sft_data(script_args, tokenizer=None):
    """The toy world's SFT rows, or a dataset's, rendered with the tokenizer's chat template when it has one."""
    if script_args.dataset_name == "toy":
        return load_sft(ToyWorld(ToyWorldConfig(seed=script_args.toy_seed)).sft_rows(), "prompt-completion")
    return load_sft(script_args.dataset_name, script_args.dataset_format, split=script_args.dataset_split,
                    skip_bad_rows=script_args.skip_bad_rows, tokenizer=tokenizer)
