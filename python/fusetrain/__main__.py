"""`python -m fusetrain`: prints the version and the CPU features the kernels use."""

import fusetrain


def main() -> None:
    """Prints fusetrain's version and this CPU's instruction-set features."""
    print(f"fusetrain {fusetrain.__version__}")
    print(f"cpu features: {fusetrain.cpu_features() or '(baseline x86-64 only)'}")


if __name__ == "__main__":
    main()
