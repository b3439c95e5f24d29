from pathlib import Path

from django.conf import settings
from django.db import migrations, models


def demo_nodes_follow_setup(apps, schema_editor):
    """A demo node made before this field whose torchrun is what bin/start detects (the repo's node env, or the
    bare name used when there was none) was detected, not chosen by anyone: it follows bin/setup --node-env."""
    node = apps.get_model("cluster", "Node")
    detected = ["torchrun", str(Path(settings.BASE_DIR) / ".venv-node" / "bin" / "torchrun")]
    for demo in node.objects.filter(name="local", transport="local", torchrun_command__in=detected):
        demo.torchrun_auto = demo.torchrun_command
        demo.save(update_fields=["torchrun_auto"])


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0007_node_workdir_id"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="torchrun_auto",
            field=models.CharField(
                blank=True,
                help_text="The torchrun command UGRO chose itself for this local node (the demo node). While the "
                "torchrun command is still this one, each launch chooses again (the repo's .venv-node once "
                "`bin/setup --node-env` made it); a torchrun command set by hand is kept.",
                max_length=500,
            ),
        ),
        migrations.RunPython(demo_nodes_follow_setup, migrations.RunPython.noop),
    ]
