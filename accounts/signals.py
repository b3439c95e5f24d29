"""New accounts start with the default role (UGRO_DEFAULT_ROLE, viewer unless set to none)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db.models.signals import post_save
from django.dispatch import receiver


@receiver(post_save, sender=get_user_model())
def give_default_role(sender, instance, created: bool, raw: bool = False, **kwargs) -> None:
    role = settings.UGRO.get("DEFAULT_ROLE", "viewer")
    if created and not raw and role != "none":
        group = Group.objects.filter(name=role).first()
        if group is not None:
            instance.groups.add(group)
