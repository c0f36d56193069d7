"""A component whose library is not installed (as `experiment=dict_lm_transformers` without the
transformers extra): building it must say what to pip install, in one line."""


def model(in_features: int, out_features: int):
    import transformers_not_installed_anywhere  # noqa: F401

    raise AssertionError("unreachable: that module does not exist")
