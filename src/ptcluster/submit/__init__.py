"""``ptcluster submit``: an sbatch script whose body is ``ptcluster run``, written and submitted."""
