"""Train a model with DP-SGD and save checkpoints to models/<save-name>/.

    python train_dpsgd.py                      # LeNet-5 on the shipped MNIST subset, ε = 10
    python train_dpsgd.py --sigma 1.0 --reduction mean --batch-size 512

The mechanism is accounting.md §1: Poisson sampling with q = batch_size/N, per-sample
transform h (flat clipping, psac or psasc) bounded by Γ, Gaussian noise of std σΓ,
sum or mean update rule. Rerunning the same command resumes an interrupted run.
"""

from perinstance import checkpoints, training
from perinstance.errors import run_main
from perinstance.options import Parser, add_training_args


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    add_training_args(parser)
    args = parser.parse_args(argv)

    metadata = training.train(args)

    run_dir = training.run_dir_for(args)
    steps = checkpoints.saved_steps(run_dir)
    privacy = ("non-private" if metadata["dp"] == 0 else
               f"σ={metadata['noise_multiplier']:.4g} q={metadata['sample_rate']:.4g} δ={metadata['delta']:g}"
               + (f" (target ε={metadata['target_eps']:g})" if metadata["target_eps"] else ""))
    status = "already trained" if metadata["resumed_from"] == metadata["total_steps"] else (
        f"trained steps {metadata['resumed_from'] + 1}-{metadata['total_steps']} in {metadata['train_seconds']:.1f}s")
    print(f"{metadata['run']}: {status}; {privacy}; test accuracy {metadata['final_test_accuracy']:.4f}; "
          f"{len(steps)} checkpoints in {run_dir}")


if __name__ == "__main__":
    run_main(main)
