"""The project's own Python environment, head side: the declared file (a ``uv.lock``, a
``pylock.toml``, a ``requirements*.txt`` or a ``pyproject.toml``) -> an exact, content-addressed
set of wheels for a node platform (``resolve.resolve``), kept in the head's ``WheelStore``.

``resolved`` holds the values both sides use (``Wheel``, ``Platform``, ``ResolvedEnv`` and its
digest, the environment's key on every node); ``declared`` reads the four file kinds (``reqfile``
requirements files and ``pyproject.toml``, ``lockfiles`` the two locks, into ``pins``);
``fetch`` brings wheels into the ``store`` (``--find-links`` folders, pip's download, an sdist
built only with trust); ``tools`` the uv wheel that travels with the environment; ``platforms``
says a node platform in each tool's words; ``resolve`` puts them together, cached by the file's
content; ``choice`` picks the file a command uses. Then ``ship`` and ``nodes`` send the
missing wheels and build the environment on every node (the node side is ``node.venv_agent``),
and ``runenv`` is ``run``'s and doctor's use of it (``known``: what the head remembers of each
node, so that an unchanged environment is launched without asking first). Named for the command
``ptcluster venvs``; ``ptcluster env`` stays the variables ranks get.
"""
