"""The roles as groups of permissions: made by migration 0002_roles and again after every migrate/flush."""

from __future__ import annotations

# role -> (app_label, model, codename, name) it holds; each role holds the one before it too
_VIEW = [("accounts", "access", "view_cluster", "See jobs, nodes, logs and metrics")]
_LAUNCH = [("accounts", "access", "launch_job", "Launch jobs; cancel and resume one's own")]
_OPERATE = [
    ("accounts", "access", "manage_any_job", "Cancel and resume anyone's job"),
    ("accounts", "access", "any_priority", "Launch at any priority (0-100)"),
    ("accounts", "access", "manage_nodes", "Change nodes, drain and undrain them"),
    ("accounts", "access", "view_audit", "Read the audit log"),
    # the admin's own node and job pages
    ("cluster", "node", "view_node", "Can view node"),
    ("cluster", "node", "change_node", "Can change node"),
    ("cluster", "node", "add_node", "Can add node"),
    ("jobs", "job", "view_job", "Can view job"),
    ("accounts", "auditevent", "view_auditevent", "Can view audit event"),
]
ROLE_PERMISSIONS = {
    "viewer": _VIEW,
    "launcher": _VIEW + _LAUNCH,
    "operator": _VIEW + _LAUNCH + _OPERATE,
}


def ensure_roles(apps=None) -> None:
    """Create the viewer, launcher and operator groups with their permissions (idempotent)."""
    if apps is None:
        from django.apps import apps
    group_model = apps.get_model("auth", "Group")
    permission_model = apps.get_model("auth", "Permission")
    content_type_model = apps.get_model("contenttypes", "ContentType")
    for role, perms in ROLE_PERMISSIONS.items():
        group, _ = group_model.objects.get_or_create(name=role)
        wanted = []
        for app_label, model, codename, name in perms:
            ct, _ = content_type_model.objects.get_or_create(app_label=app_label, model=model)
            perm, _ = permission_model.objects.get_or_create(
                content_type=ct, codename=codename, defaults={"name": name}
            )
            wanted.append(perm)
        group.permissions.add(*wanted)
