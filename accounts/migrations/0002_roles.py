"""The roles viewer, launcher and operator as groups with their permissions (accounts/roles.py)."""

from django.db import migrations


def make_roles(apps, schema_editor):
    from accounts.roles import ensure_roles

    ensure_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("cluster", "0003_node_poll_lease"),
        ("jobs", "0004_job_owner"),
    ]

    operations = [migrations.RunPython(make_roles, migrations.RunPython.noop)]
