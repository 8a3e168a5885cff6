"""Reading a dataset wherever it lives: a local .jsonl/.json/.parquet/.csv file (.jsonl.gz and the like too), a
local directory (split files such as train.jsonl and test.jsonl, a hub snapshot's shards, or a `save_to_disk`
directory: how data reaches compute nodes without internet), or a Hugging Face hub dataset. A file is one table; a
directory or hub dataset has named splits. Prompts (common/data/prompts.py) and preference pairs
(common/data/preferences.py) both read their tables here; every failure is one line naming the dataset.
"""

import os

LOCAL_FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # datasets reads json and csv files compressed with these


def first_line(error: Exception) -> str:
    """Library errors can run to pages; one line of them is enough to say what went wrong."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def _file_format(path: str) -> str | None:
    """The `datasets` loader for a local file ("json", "parquet", "csv"), by its extension, or None."""
    stem, extension = os.path.splitext(path)
    if extension in COMPRESSIONS:
        stem, extension = os.path.splitext(stem)
        return None if extension == ".parquet" else LOCAL_FILE_LOADERS.get(extension)
    return LOCAL_FILE_LOADERS.get(extension)


def _is_local_file(dataset: str) -> bool:
    return _file_format(dataset) is not None


def _read_local_file(path: str):
    import datasets  # imported here: the built-in task needs none of it

    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"dataset file is empty: {path}")
    loader = _file_format(path)
    try:
        return datasets.load_dataset(loader, data_files=path, split="train")
    except Exception as error:
        raise ValueError(f"could not read {path} (empty or malformed?): {first_line(error)}") from error


def _read_hub(dataset: str, config: str | None):
    """A DatasetDict of every split of a hub dataset."""
    import datasets

    try:
        return datasets.load_dataset(dataset, config)
    except Exception as error:
        raise ValueError(
            f"could not load hub dataset {dataset!r} (config={config!r}): the hub could not be reached or the "
            f"dataset does not exist ({first_line(error)}); a local .jsonl/.json/.parquet/.csv file or a directory "
            f"of them works too"
        ) from error


def _is_saved_to_disk(path: str) -> bool:
    """save_to_disk writes dataset_dict.json (a DatasetDict) or state.json beside dataset_info.json (a Dataset)."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or all(
        os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_info.json"))


def _read_local_dir(path: str, config: str | None):
    """A directory as `datasets` keeps them: save_to_disk's (load_from_disk: a Dataset or a DatasetDict), or data
    files that load_dataset sorts into splits by their names (train.jsonl, test.jsonl; a hub snapshot's
    data/train-00000-of-00001.parquet; the configurations a snapshot's README.md lists, `config` picking one)."""
    import datasets

    try:
        return datasets.load_from_disk(path) if _is_saved_to_disk(path) else datasets.load_dataset(path, config)
    except Exception as error:
        configs = _config_names(path) if config is None else []
        if len(configs) > 1:  # a snapshot of a hub dataset with several configurations, such as openai/gsm8k's
            raise ValueError(f"{path} holds several configurations, {configs}: name one (--dataset-config, or "
                             f"--eval-dataset-config for --eval-dataset)") from error
        raise ValueError(f"could not read the directory {path} as a dataset (split files such as train.jsonl and "
                         f"test.jsonl, a hub snapshot, or a save_to_disk directory): {first_line(error)}") from error


def _config_names(path: str) -> list[str]:
    import datasets

    try:
        return datasets.get_dataset_config_names(path)
    except Exception:  # noqa: BLE001 - only a hint for the error being raised
        return []


def read_dataset(dataset: str, config: str | None = None):
    """A local file, or a directory save_to_disk wrote one Dataset to: one table (a `datasets.Dataset`). A local
    directory of splits or a hub dataset: {split: table} (a `datasets.DatasetDict`, a dict)."""
    if _is_local_file(dataset):
        return _read_local_file(dataset)
    if os.path.isdir(dataset):
        return _read_local_dir(dataset, config)
    if os.path.exists(dataset):
        raise ValueError(f"dataset {dataset!r}: a local file must end in one of "
                         f"{', '.join(LOCAL_FILE_LOADERS)} (optionally compressed: {', '.join(COMPRESSIONS)}); "
                         f"a directory of such files works too")
    if dataset.startswith((".", "/", "~")):  # a path, never a hub id: say it is missing, not that the hub is
        raise FileNotFoundError(f"dataset not found: {dataset} (no such file or directory)")
    return _read_hub(dataset, config)


def dataset_split(tables, split: str, dataset: str) -> tuple:
    """(table, its name for messages) of one split of read_dataset's result. A single table (a file) has no split
    names: it is every split. A missing split is an error naming those the dataset has."""
    if not isinstance(tables, dict):
        return tables, dataset
    if split not in tables:
        raise ValueError(f"{dataset}: no split {split!r}; existing splits: {list(tables)}")
    return tables[split], f"{dataset}[{split}]"


def read_split(dataset: str, config: str | None, split: str) -> tuple:
    """(table, its name for messages) of one split of a local file, a local directory or a hub dataset."""
    return dataset_split(read_dataset(dataset, config), split, dataset)


def train_eval_tables(dataset: str, config: str | None, eval_split: str, eval_dataset: str | None = None,
                      eval_dataset_config: str | None = None, eval_dataset_split: str = "test",
                      train_split: str = "train") -> tuple[tuple, tuple | None]:
    """The training table and the held-out one, each as (table, name). With eval_dataset, the held-out table is
    its eval_dataset_split (a file: all of it) and training takes the whole train split; without, it is the
    dataset's eval_split, or None where there is none (a file, or no such split): the caller then holds rows of the
    training table out."""
    tables = read_dataset(dataset, config)
    train = dataset_split(tables, train_split, dataset)
    if eval_dataset is not None:
        return train, read_split(eval_dataset, eval_dataset_config, eval_dataset_split)
    if isinstance(tables, dict) and eval_split in tables:
        return train, (tables[eval_split], f"{dataset}[{eval_split}]")
    return train, None


def check_eval_dataset(dataset: str | None, eval_dataset: str | None) -> None:
    if dataset is None and eval_dataset is not None:
        raise ValueError("--eval-dataset needs --dataset: the built-in task has its own held-out set")


def check_table(table, columns: list[str], source: str) -> None:
    """One line for a table that lacks a needed column (naming those it has) or has no rows."""
    missing = [key for key in columns if key not in table.column_names]
    if missing:
        raise ValueError(f"{source}: missing column(s) {missing}; existing columns: {table.column_names}")
    if len(table) == 0:
        raise ValueError(f"{source}: dataset is empty (0 rows)")
