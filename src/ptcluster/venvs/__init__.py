"""The project's own Python environment, head side: the declared file (a ``uv.lock``, a
``pylock.toml``, a ``requirements*.txt`` or a ``pyproject.toml``) -> an exact, content-addressed
set of wheels for a node platform (``resolve.resolve``), kept in the head's ``WheelStore``.

``resolved`` holds the values both sides use (``Wheel``, ``Platform``, ``ResolvedEnv`` and its
digest, the environment's key on every node); ``declared`` reads the four file kinds;
``lockfiles`` picks a lock's wheels for a platform; ``fetch`` brings wheels into the store
(``--find-links`` folders, pip's download, the head's own uv); ``resolve`` puts them together,
cached by the file's content. Named for the command ``ptcluster venvs``; ``ptcluster env`` stays
the variables ranks get.
"""
