"""`report.environment()`: what every result records of the machine that made it."""

import platform

from kvdistill.report import cpu_model, environment, format_environment


def test_cpu_model_reads_the_first_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 7B13\n")
    assert cpu_model(str(info)) == "AMD EPYC 7B13"


def test_cpu_model_falls_back_to_platform_without_cpuinfo(tmp_path):
    assert cpu_model(str(tmp_path / "absent")) == (platform.processor() or platform.machine())
    (tmp_path / "empty").write_text("processor\t: 0\n")  # no model name line (some ARM kernels)
    assert cpu_model(str(tmp_path / "empty")) == (platform.processor() or platform.machine())


def test_environment_names_the_cpu_and_its_line_drops_only_the_date():
    env = environment()
    assert env["processor"] == cpu_model() and env["processor"]
    line = format_environment(env)
    assert f"processor {env['processor']}" in line and env["date"] not in line
