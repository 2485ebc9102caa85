"""First run, no extra steps: a local staff account and a one-time login link, on loopback only.

``serve`` on a loopback address prints a link that signs its reader in as the local account
(created on first use, with no password), the way Jupyter prints its token URL. The link works
once (Django's password-reset tokens: signing in changes ``last_login``, which invalidates it),
only from this machine, and never for a server listening on another address: real deployments
make staff accounts with ``createsuperuser``.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.tokens import default_token_generator
from django.urls import reverse
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

__all__ = ["LOCAL_USERNAME", "local_login_path"]

#: The account the link signs in as.
LOCAL_USERNAME = "local"


def local_login_path() -> str:
    """The path of a fresh one-time login link for the local staff account (made if missing)."""
    User = get_user_model()
    user, created = User.objects.get_or_create(username=LOCAL_USERNAME,
                                               defaults={"is_staff": True, "is_superuser": True})
    if created:
        user.set_unusable_password()  # the links are the only way in
        user.save()
    uid = urlsafe_base64_encode(force_bytes(user.pk))
    return reverse("dashboard-local-login", args=[uid, default_token_generator.make_token(user)])
