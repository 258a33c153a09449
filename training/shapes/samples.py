"""The seeds of the quality samples, named once: the bench, the levers bench and the advisor draw their
sample prompts and images with these (bench/quality.py), and the trainer's fidelity check draws
its prompts and images with the same prompt seed, so a trained model is graded on what the bench shows.
Torch-free."""

PROMPT_SEED = 7  # which prompts of the grammar the quality samples are
IMAGE_SEED = 1000  # the first sample image's seed; sample i has IMAGE_SEED + i


def image_seeds(n: int) -> list[int]:
    """The seeds of `n` quality sample images."""
    return [IMAGE_SEED + i for i in range(n)]
